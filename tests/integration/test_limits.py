"""What one request may cost a real `artlike serve`: the completion log grows by a request's body once (not
once per choice), `n` on a trajectory URL is capped, and a trajectory can be deleted."""

from __future__ import annotations

import sqlite3
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from artlike_server.launcher import ServerProcess

pytestmark = pytest.mark.integration

MESSAGES = [{"role": "user", "content": "Say hi."}]


def chat(server: ServerProcess, trajectory_id: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{server.base_url}/t/{trajectory_id}/v1/chat/completions", headers=server.headers,
                      json={"model": server.model_id, "messages": MESSAGES, "max_tokens": 2} | body, timeout=300)


def log_bytes(server: ServerProcess) -> int:
    """Bytes of the completion log's pages in use, as a reader sees them (WAL included)."""
    connection = sqlite3.connect(f"file:{Path(server.data_dir) / 'completions.sqlite'}?mode=ro", uri=True)
    try:
        page_size, pages, free = (connection.execute(f"PRAGMA {name}").fetchone()[0]
                                  for name in ("page_size", "page_count", "freelist_count"))
    finally:
        connection.close()
    return int((pages - free) * page_size)


def test_n_16_with_a_big_unknown_field_grows_the_log_by_about_one_body(server: ServerProcess) -> None:
    padding = "x" * 2_000_000  # passed through to vLLM, which ignores unknown fields
    before = log_bytes(server)

    response = chat(server, f"limits-{uuid.uuid4().hex}", n=16, temperature=1.0, artlike_test_padding=padding)

    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 16
    growth = log_bytes(server) - before
    assert len(padding) < growth < 1.5 * len(padding)  # schema 1 stored it 16 times (> 32 MB)


def test_n_over_the_recorded_choices_limit_is_a_400_naming_n(server: ServerProcess) -> None:
    response = chat(server, f"limits-{uuid.uuid4().hex}", n=17)

    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("n", "too_many_choices")
    assert "16" in error["message"]


def test_delete_trajectory_removes_it_then_answers_404(server: ServerProcess) -> None:
    trajectory_id = f"limits-{uuid.uuid4().hex}"
    assert chat(server, trajectory_id).status_code == 200
    url = f"{server.base_url}/v1/trajectories/{trajectory_id}"

    deleted = httpx.delete(url, headers=server.headers, timeout=30)

    assert deleted.status_code == 204 and deleted.content == b""
    assert httpx.get(url, headers=server.headers, timeout=30).status_code == 404
    again = httpx.delete(url, headers=server.headers, timeout=30)
    assert again.status_code == 404 and again.json()["error"]["code"] == "trajectory_not_found"
    assert httpx.delete(url, timeout=30).status_code == 401  # behind the API key like every route
