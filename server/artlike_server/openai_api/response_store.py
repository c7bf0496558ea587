"""Stored Responses API responses: what `previous_response_id` continues and `GET /v1/responses/{id}` returns.

A response is stored (OpenAI's default, `store: true`) with the conversation it ended as chat messages (its
input without the `instructions`, which OpenAI does not carry over, plus its output), so the next request's
prompt is that conversation plus the new input. One SQLite file (WAL) in the data dir; the work runs in a
thread, one connection behind a lock (rows are small and writes rare next to completions). Entries older
than the completion log's retention are pruned with it.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id          TEXT PRIMARY KEY,
    created_at  REAL NOT NULL,
    messages    BLOB NOT NULL,   -- the conversation so far, as chat messages (JSON)
    response    BLOB NOT NULL    -- the response object as returned (JSON)
);
CREATE INDEX IF NOT EXISTS responses_by_age ON responses (created_at);
"""


@dataclass(frozen=True, slots=True)
class StoredResponse:
    id: str
    created_at: float
    messages: list[dict[str, Any]]
    response: dict[str, Any]


class ResponseStore:
    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=10)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    async def save(self, stored: StoredResponse) -> None:
        row = (stored.id, stored.created_at, orjson.dumps(stored.messages), orjson.dumps(stored.response))
        await asyncio.to_thread(self._execute, "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?)", row)

    async def get(self, response_id: str) -> StoredResponse | None:
        rows = await asyncio.to_thread(
            self._execute, "SELECT id, created_at, messages, response FROM responses WHERE id = ?", (response_id,)
        )
        if not rows:
            return None
        found = rows[0]
        return StoredResponse(found[0], found[1], orjson.loads(found[2]), orjson.loads(found[3]))

    async def delete(self, response_id: str) -> bool:
        return bool(await asyncio.to_thread(self._changes, "DELETE FROM responses WHERE id = ?", (response_id,)))

    async def prune(self, max_age_seconds: float, *, now: float | None = None) -> int:
        """Delete responses older than `max_age_seconds`; the number deleted."""
        cutoff = (time.time() if now is None else now) - max_age_seconds
        return await asyncio.to_thread(self._changes, "DELETE FROM responses WHERE created_at < ?", (cutoff,))

    def _execute(self, sql: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        with self._lock:
            return self._db.execute(sql, params).fetchall()

    def _changes(self, sql: str, params: tuple[Any, ...]) -> int:
        with self._lock:
            return self._db.execute(sql, params).rowcount
