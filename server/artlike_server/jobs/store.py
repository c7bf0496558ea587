"""Jobs, their events and checkpoints in SQLite, so a restart finds every job where it was.

One connection (WAL, synchronous=NORMAL) behind a lock; every write is one short transaction, fast enough
to make from the event loop. Each job also has a directory (`jobs/<id>/`) holding its datasets as
JSONL, copied at creation so that deleting the uploaded file never breaks a running job.

Events are append-only with a global sequence number; their public id is `ftevent-<seq>`, so "events
after X" is a range query.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson

from ..fsync import fsync_directory
from .spec import FINISHED, JobSpec, JobStatus

EventLevel = Literal["info", "warn", "error"]
EventType = Literal["message", "metrics"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    created_at INTEGER NOT NULL,
    status TEXT NOT NULL,
    spec TEXT NOT NULL,
    training_file TEXT,
    validation_file TEXT,
    suffix TEXT,
    metadata TEXT,
    start_step INTEGER,
    iteration INTEGER NOT NULL DEFAULT 0,
    trained_tokens INTEGER NOT NULL DEFAULT 0,
    last_metrics TEXT,
    error TEXT,
    finished_at INTEGER,
    stop_request TEXT
);
CREATE INDEX IF NOT EXISTS jobs_created ON jobs (created_at, id);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    level TEXT NOT NULL,
    message TEXT NOT NULL,
    type TEXT NOT NULL,
    data TEXT
);
CREATE INDEX IF NOT EXISTS events_job ON events (job_id, seq);
CREATE TABLE IF NOT EXISTS checkpoints (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    step_number INTEGER NOT NULL,
    model_checkpoint TEXT NOT NULL,
    metrics TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS checkpoints_job ON checkpoints (job_id, seq);
"""

_UPDATABLE = frozenset({"status", "start_step", "iteration", "trained_tokens", "last_metrics", "error",
                        "finished_at", "stop_request", "metadata"})


@dataclass(frozen=True)
class JobRecord:
    id: str
    created_at: int
    status: JobStatus
    spec: JobSpec
    training_file: str | None
    validation_file: str | None
    suffix: str | None
    metadata: dict[str, str] | None
    start_step: int | None  # the target model's step when the job first started training
    iteration: int  # iterations done (committed)
    trained_tokens: int
    last_metrics: dict[str, Any]
    error: dict[str, Any] | None  # {"code", "message", "param"}
    finished_at: int | None
    stop_request: Literal["cancel", "pause"] | None

    @property
    def finished(self) -> bool:
        return self.status in FINISHED


@dataclass(frozen=True)
class EventRecord:
    seq: int
    job_id: str
    created_at: int
    level: EventLevel
    message: str
    type: EventType
    data: dict[str, Any] | None

    @property
    def id(self) -> str:
        return f"ftevent-{self.seq}"


@dataclass(frozen=True)
class CheckpointRecord:
    seq: int
    job_id: str
    created_at: int
    step_number: int
    model_checkpoint: str
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"ftckpt-{self.seq}"


def event_seq(event_id: str) -> int | None:
    """`ftevent-12` -> 12; anything else -> None."""
    prefix = "ftevent-"
    if event_id.startswith(prefix) and event_id[len(prefix):].isdigit():
        return int(event_id[len(prefix):])
    return None


def _now() -> int:
    return int(time.time())


class JobStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(root / "jobs.sqlite", check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self.on_event: Callable[[str], None] | None = None  # told the job id after each event is written

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def job_dir(self, job_id: str) -> Path:
        return self.root / job_id

    # ----------------------------------------------------------------------------------------- jobs

    def create(self, job_id: str, spec: JobSpec, *, training_file: str | None, validation_file: str | None,
               suffix: str | None, metadata: dict[str, str] | None, train_rows: list[Any],
               validation_rows: list[Any]) -> JobRecord:
        """Write the job's datasets, then its row (status queued): a job row always has its data."""
        directory = self.job_dir(job_id)
        directory.mkdir(parents=True, exist_ok=True)
        _write_jsonl(directory / "train.jsonl", train_rows)
        _write_jsonl(directory / "validation.jsonl", validation_rows)
        with self._lock:
            self._db.execute(
                "INSERT INTO jobs (id, created_at, status, spec, training_file, validation_file, suffix, metadata)"
                " VALUES (?, ?, 'queued', ?, ?, ?, ?, ?)",
                (job_id, _now(), spec.model_dump_json(), training_file, validation_file, suffix,
                 orjson.dumps(metadata).decode() if metadata is not None else None))
        return self.get(job_id)

    def rows(self, job_id: str, which: Literal["train", "validation"]) -> list[Any]:
        path = self.job_dir(job_id) / f"{which}.jsonl"
        return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]

    def get(self, job_id: str) -> JobRecord:
        with self._lock:
            row = self._db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise KeyError(job_id)
        return _job(row)

    def find(self, job_id: str) -> JobRecord | None:
        try:
            return self.get(job_id)
        except KeyError:
            return None

    def page(self, *, limit: int, after: str | None = None,
             metadata: dict[str, str] | None = None) -> tuple[list[JobRecord], bool]:
        """Newest first; `after` is the id of the last job of the previous page. Returns (jobs, has_more)."""
        query, params = "SELECT * FROM jobs", []  # type: tuple[str, list[Any]]
        if after is not None:
            anchor = self.get(after)
            query += " WHERE (created_at, id) < (?, ?)"
            params += [anchor.created_at, anchor.id]
        query += " ORDER BY created_at DESC, id DESC"
        with self._lock:
            rows = self._db.execute(query, params).fetchall()
        jobs = [_job(r) for r in rows]
        if metadata:
            jobs = [j for j in jobs if j.metadata and all(j.metadata.get(k) == v for k, v in metadata.items())]
        return jobs[:limit], len(jobs) > limit

    def unfinished(self) -> list[JobRecord]:
        """Jobs a restart must pick up again, oldest first (their queue order)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM jobs WHERE status IN ('validating_files', 'queued', 'running')"
                " ORDER BY created_at, id").fetchall()
        return [_job(r) for r in rows]

    def update(self, job_id: str, **fields: Any) -> JobRecord:
        unknown = fields.keys() - _UPDATABLE
        if unknown:  # column names go into the SQL text: only the fixed set, never a caller's string
            raise ValueError(f"not updatable job fields: {sorted(unknown)}")
        encoded = {k: (orjson.dumps(v).decode() if k in {"last_metrics", "error", "metadata"} and v is not None
                       else v) for k, v in fields.items()}
        if fields.get("status") in FINISHED:
            encoded.setdefault("finished_at", _now())
        columns = ", ".join(f"{k} = ?" for k in encoded)
        with self._lock:
            self._db.execute(f"UPDATE jobs SET {columns} WHERE id = ?", (*encoded.values(), job_id))
        return self.get(job_id)

    # --------------------------------------------------------------------------------------- events

    def add_event(self, job_id: str, message: str, *, level: EventLevel = "info", type: EventType = "message",
                  data: dict[str, Any] | None = None) -> EventRecord:
        created = _now()
        with self._lock:
            cursor = self._db.execute(
                "INSERT INTO events (job_id, created_at, level, message, type, data) VALUES (?, ?, ?, ?, ?, ?)",
                (job_id, created, level, message, type, orjson.dumps(data).decode() if data is not None else None))
        assert cursor.lastrowid is not None
        if self.on_event is not None:
            self.on_event(job_id)
        return EventRecord(cursor.lastrowid, job_id, created, level, message, type, data)

    def events(self, job_id: str, *, after_seq: int | None = None, limit: int = 1000,
               newest_first: bool = False) -> list[EventRecord]:
        """Newest first (OpenAI's listing: `after` = older than that event) or oldest first (following)."""
        if newest_first:
            query = "SELECT * FROM events WHERE job_id = ? AND seq < ? ORDER BY seq DESC LIMIT ?"
            params: tuple[Any, ...] = (job_id, after_seq if after_seq is not None else 2 ** 62, limit)
        else:
            query = "SELECT * FROM events WHERE job_id = ? AND seq > ? ORDER BY seq LIMIT ?"
            params = (job_id, after_seq or 0, limit)
        with self._lock:
            rows = self._db.execute(query, params).fetchall()
        return [EventRecord(r[0], r[1], r[2], r[3], r[4], r[5], orjson.loads(r[6]) if r[6] else None)
                for r in rows]

    # ---------------------------------------------------------------------------------- checkpoints

    def add_checkpoint(self, job_id: str, step_number: int, model_checkpoint: str,
                       metrics: dict[str, float]) -> CheckpointRecord:
        created = _now()
        with self._lock:
            cursor = self._db.execute(
                "INSERT INTO checkpoints (job_id, created_at, step_number, model_checkpoint, metrics)"
                " VALUES (?, ?, ?, ?, ?)", (job_id, created, step_number, model_checkpoint, orjson.dumps(metrics)))
        assert cursor.lastrowid is not None
        return CheckpointRecord(cursor.lastrowid, job_id, created, step_number, model_checkpoint, metrics)

    def checkpoints(self, job_id: str) -> list[CheckpointRecord]:
        """Newest first, as OpenAI lists them."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM checkpoints WHERE job_id = ? ORDER BY seq DESC",
                                    (job_id,)).fetchall()
        return [CheckpointRecord(r[0], r[1], r[2], r[3], r[4], orjson.loads(r[5])) for r in rows]


def _write_jsonl(path: Path, rows: list[Any]) -> None:
    # On disk, bytes and name, before the job's row commits: a job row always has its data.
    temporary = path.with_suffix(".tmp")
    with open(temporary, "wb") as handle:
        handle.write(b"".join(orjson.dumps(row) + b"\n" for row in rows))
        handle.flush()
        os.fsync(handle.fileno())
    temporary.replace(path)
    fsync_directory(path.parent)


def _job(row: tuple[Any, ...]) -> JobRecord:
    (job_id, created_at, status, spec, training_file, validation_file, suffix, metadata, start_step, iteration,
     trained_tokens, last_metrics, error, finished_at, stop_request) = row
    return JobRecord(
        id=job_id, created_at=created_at, status=status, spec=JobSpec.model_validate_json(spec),
        training_file=training_file, validation_file=validation_file, suffix=suffix,
        metadata=orjson.loads(metadata) if metadata else None, start_step=start_step, iteration=iteration,
        trained_tokens=trained_tokens, last_metrics=orjson.loads(last_metrics) if last_metrics else {},
        error=orjson.loads(error) if error else None, finished_at=finished_at, stop_request=stop_request)
