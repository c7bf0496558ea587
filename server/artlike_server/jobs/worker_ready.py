"""The start handshake of the server's worker processes (sandbox and grader workers): one JSON line."""

from __future__ import annotations

import asyncio
import json
from typing import Any


async def read_ready_line(process: asyncio.subprocess.Process, timeout_s: float) -> dict[str, Any]:
    """The worker's first stdout line as JSON ({} when it said nothing in time or exited); `ok` means ready."""
    assert process.stdout is not None
    try:
        ready = await asyncio.wait_for(process.stdout.readline(), timeout_s)
    except TimeoutError:
        return {}
    reply: dict[str, Any] = json.loads(ready) if ready else {}
    return reply
