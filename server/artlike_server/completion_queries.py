"""Browsing the completion log: completions by id, newest completions and trajectories under filters.

Pure query builders over the log's reader connection (`CompletionLog.read` runs them in a thread, in one
read transaction). Filters:

    model      a trainable model name (every step of it) or the base model id (exact `served_model`)
    step       one adapter step
    metadata   {key: value}: the caller's `metadata` field of the request body (OpenAI's chat `metadata`)
    since/until  created_at bounds (unix seconds)
    before     a cursor: only rows with a smaller id (newest first, pages go back in time)
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from artlike.types import CompletionRecord

from .completion_log import _SELECT, _record
from .errors import InvalidRequest

MAX_PAGE = 1000
MAX_METADATA_KEY = 64


@dataclass(frozen=True)
class CompletionFilter:
    model: str | None = None
    step: int | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)
    since: float | None = None
    until: float | None = None
    trajectory_ids: Sequence[str] | None = None

    def where(self) -> tuple[list[str], list[Any]]:
        clauses: list[str] = []
        params: list[Any] = []
        if self.model is not None:
            # A trainable model's steps are served as "name@N"; the base model by its own id.
            clauses.append("(c.served_model = ? OR substr(c.served_model, 1, ?) = ?)")
            params += [self.model, len(self.model) + 1, f"{self.model}@"]
        if self.step is not None:
            clauses.append("c.step = ?")
            params.append(self.step)
        for key, value in self.metadata.items():
            # The key is bound, never spliced into the SQL or a JSON path: any key text is just data.
            clauses.append("EXISTS (SELECT 1 FROM json_each(CAST(r.body AS TEXT), '$.metadata') AS m "
                           "WHERE m.key = ? AND m.value = ?)")
            params += [_metadata_key(key), value]
        if self.since is not None:
            clauses.append("c.created_at >= ?")
            params.append(self.since)
        if self.until is not None:
            clauses.append("c.created_at <= ?")
            params.append(self.until)
        if self.trajectory_ids is not None:
            clauses.append(f"c.trajectory_id IN ({', '.join('?' * len(self.trajectory_ids))})")
            params += list(self.trajectory_ids)
        return clauses, params


def _metadata_key(key: str) -> str:
    # OpenAI's metadata keys are 1-64 characters; any characters, quotes included, since the key is bound.
    if not 1 <= len(key) <= MAX_METADATA_KEY:
        raise InvalidRequest(f"a metadata filter key must be 1-{MAX_METADATA_KEY} characters, not {len(key)}",
                             param="metadata", code="invalid_filter")
    return key


def parse_metadata_filter(values: Sequence[str]) -> dict[str, str]:
    """`["source=studio", "user=ann"]` → {"source": "studio", "user": "ann"} (400 without '=')."""
    parsed: dict[str, str] = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep:
            raise InvalidRequest(f"metadata filter {item!r} must be key=value", param="metadata",
                                 code="invalid_filter")
        parsed[_metadata_key(key.strip())] = value.strip()
    return parsed


def completions_by_id(connection: sqlite3.Connection, ids: Sequence[int]) -> dict[int, CompletionRecord]:
    found: dict[int, CompletionRecord] = {}
    for start in range(0, len(ids), 500):
        chunk = list(ids[start:start + 500])
        query = f"{_SELECT} WHERE c.id IN ({', '.join('?' * len(chunk))})"
        for row in connection.execute(query, chunk):
            found[row[0]] = _record(row)
    return found


def newest_completions(connection: sqlite3.Connection, where: CompletionFilter, *, before: int | None,
                       limit: int) -> list[CompletionRecord]:
    """Completions matching `where`, newest first, with ids below `before`."""
    clauses, params = where.where()
    if before is not None:
        clauses.append("c.id < ?")
        params.append(before)
    condition = f" WHERE {' AND '.join(clauses)}" if clauses else ""
    query = f"{_SELECT}{condition} ORDER BY c.id DESC LIMIT ?"
    return [_record(row) for row in connection.execute(query, [*params, limit])]


@dataclass(frozen=True)
class TrajectorySummary:
    trajectory_id: str
    last_id: int  # the cursor of the page
    created_at: float
    completions: int
    models: list[str]
    steps: list[int]
    metadata: dict[str, Any]


def newest_trajectories(connection: sqlite3.Connection, where: CompletionFilter, *, before: int | None,
                        limit: int) -> list[TrajectorySummary]:
    """Trajectories with a completion matching `where`, the most recently active first (cursor: `last_id`)."""
    clauses, params = where.where()
    condition = f" WHERE {' AND '.join(clauses)}" if clauses else ""
    having = " HAVING MAX(c.id) < ?" if before is not None else ""
    query = (
        "SELECT c.trajectory_id, MAX(c.id), MIN(c.created_at), COUNT(*), GROUP_CONCAT(DISTINCT c.served_model), "
        "GROUP_CONCAT(DISTINCT c.step), MIN(r.id) FROM completions AS c JOIN requests AS r ON r.id = c.request_row"
        f"{condition} GROUP BY c.trajectory_id{having} ORDER BY MAX(c.id) DESC LIMIT ?"
    )
    rows = connection.execute(query, [*params, *([before] if before is not None else []), limit]).fetchall()
    bodies = dict(connection.execute(
        f"SELECT id, body FROM requests WHERE id IN ({', '.join('?' * len(rows))})", [row[6] for row in rows]
    ).fetchall()) if rows else {}
    return [
        TrajectorySummary(
            trajectory_id=row[0], last_id=row[1], created_at=row[2], completions=row[3],
            models=sorted(row[4].split(",")) if row[4] else [],
            steps=sorted(int(s) for s in row[5].split(",")) if row[5] else [],
            metadata=_metadata(bodies.get(row[6])),
        )
        for row in rows
    ]


def _metadata(body: bytes | None) -> dict[str, Any]:
    if not body:
        return {}
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return {}
    metadata = parsed.get("metadata") if isinstance(parsed, dict) else None
    return metadata if isinstance(metadata, dict) else {}


def request_metadata(record: CompletionRecord) -> dict[str, Any]:
    metadata = record.request.get("metadata")
    return metadata if isinstance(metadata, dict) else {}
