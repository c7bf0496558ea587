"""What the shared server recorded for a trajectory, read over plain HTTP (tests of every API use it)."""

from __future__ import annotations

from typing import Any

import httpx
from artlike_server.launcher import ServerProcess


def recorded(server: ServerProcess, trajectory_id: str) -> list[dict[str, Any]]:
    """The trajectory's recorded completions, as `GET /v1/trajectories/{id}` returns them."""
    response = httpx.get(
        f"{server.base_url}/v1/trajectories/{trajectory_id}", headers=server.headers, timeout=30
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["trajectory_id"] == trajectory_id
    completions: list[dict[str, Any]] = body["completions"]
    return completions
