"""The completion log: every completion made through a trajectory URL, token-exact, in SQLite (WAL).

Writes never run on the event loop. `submit()` puts rows on a queue; one writer thread drains the queue
and commits everything waiting in one transaction (many concurrent requests -> one commit), then resolves
each caller's future. `record()` awaits that future, so a response is sent only after its rows are
committed: a client that reads `[DONE]` and immediately posts the trajectory to `/_train_model` sees it.

Durability: WAL with `synchronous=NORMAL` — a committed transaction survives a crash of this process
(the WAL is in the OS page cache); an OS crash or power loss may lose the last commits but never corrupts
the database. Each batch is one transaction, so a process killed mid-batch leaves none of that batch.

Storage: token ids as little-endian int32 and logprobs as little-endian float64 blobs (smaller than JSON
and faster to pack and unpack than orjson); float64 keeps the engine's float32 logprobs bit-exact. The
caller's request body is stored once per request, as the JSON bytes it sent, in `requests`; each choice
row references it (schema version 2). Version 1 stored the body in every choice row, so n choices of a
large body multiplied its size in the log. Opening a version-1 file
migrates it in one transaction (rows kept, bodies deduplicated); freed pages are reused by later writes.

Retention (`prune`, `delete_trajectory`) removes whole trajectories, never single turns: a trajectory with
a missing turn would train on a different conversation than the one the model had. Reads for training
(`read_for_training`) skip the request bodies and refuse, before loading anything, more records or bytes
than the caller allows.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import sqlite3
import sys
import threading
import time
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from queue import SimpleQueue
from typing import Any, TypeVar

import orjson

from artlike.types import CompletionRecord

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

SCHEMA_VERSION = 2

_SCHEMA_V2 = (
    """
    CREATE TABLE requests (
        id               INTEGER PRIMARY KEY,
        trajectory_id    TEXT    NOT NULL,
        request_id       TEXT    NOT NULL,
        body             BLOB    NOT NULL,  -- the caller's JSON body, as sent
        created_at       REAL    NOT NULL
    )
    """,
    "CREATE INDEX requests_by_trajectory ON requests (trajectory_id)",
    """
    CREATE TABLE completions (
        id               INTEGER PRIMARY KEY,
        trajectory_id    TEXT    NOT NULL,
        request_id       TEXT    NOT NULL,
        choice_index     INTEGER NOT NULL,
        endpoint         TEXT    NOT NULL,
        model            TEXT    NOT NULL,
        served_model     TEXT    NOT NULL,
        step             INTEGER,
        request_row      INTEGER NOT NULL REFERENCES requests (id),
        prompt_token_ids BLOB    NOT NULL,  -- int32 little-endian
        output_token_ids BLOB    NOT NULL,  -- int32 little-endian
        logprobs         BLOB    NOT NULL,  -- float64 little-endian, one per output token
        finish_reason    TEXT,
        created_at       REAL    NOT NULL,
        latency_seconds  REAL    NOT NULL
    )
    """,
    "CREATE INDEX completions_by_trajectory ON completions (trajectory_id, id)",
)
"""Schema version 2, created on an empty database (user_version 0)."""

_MIGRATE_V1_TO_V2 = (
    "ALTER TABLE completions RENAME TO completions_v1",
    "DROP INDEX completions_by_trajectory",
    *_SCHEMA_V2,
    # One requests row per (trajectory, request id, body): the choices of one request share it.
    """
    INSERT INTO requests (trajectory_id, request_id, body, created_at)
    SELECT trajectory_id, request_id, request, MIN(created_at) FROM completions_v1
    GROUP BY trajectory_id, request_id, request ORDER BY MIN(id)
    """,
    """
    INSERT INTO completions (id, trajectory_id, request_id, choice_index, endpoint, model, served_model, step,
                             request_row, prompt_token_ids, output_token_ids, logprobs, finish_reason,
                             created_at, latency_seconds)
    SELECT c.id, c.trajectory_id, c.request_id, c.choice_index, c.endpoint, c.model, c.served_model, c.step,
           r.id, c.prompt_token_ids, c.output_token_ids, c.logprobs, c.finish_reason, c.created_at,
           c.latency_seconds
    FROM completions_v1 AS c JOIN requests AS r
      ON r.trajectory_id = c.trajectory_id AND r.request_id = c.request_id AND r.body = c.request
    """,
    "DROP TABLE completions_v1",
)

_COLUMNS = (
    "trajectory_id, request_id, choice_index, endpoint, model, served_model, step, request_row, "
    "prompt_token_ids, output_token_ids, logprobs, finish_reason, created_at, latency_seconds"
)
_INSERT = f"INSERT INTO completions ({_COLUMNS}) VALUES ({', '.join('?' * 14)})"
_INSERT_REQUEST = "INSERT INTO requests (trajectory_id, request_id, body, created_at) VALUES (?, ?, ?, ?)"
_SELECT = (
    "SELECT c.id, c.trajectory_id, c.request_id, c.choice_index, c.endpoint, c.model, c.served_model, c.step, "
    "r.body, c.prompt_token_ids, c.output_token_ids, c.logprobs, c.finish_reason, c.created_at, "
    "c.latency_seconds FROM completions AS c JOIN requests AS r ON r.id = c.request_row"
)
_SELECT_FOR_TRAINING = (  # no request bodies: training needs only the tokens
    "SELECT id, trajectory_id, request_id, choice_index, endpoint, model, served_model, step, NULL, "
    "prompt_token_ids, output_token_ids, logprobs, finish_reason, created_at, latency_seconds FROM completions"
)
_TOKEN_BYTES = "length(prompt_token_ids) + length(output_token_ids) + length(logprobs)"
_MAX_SQL_VARIABLES = 500  # below SQLite's lowest compiled-in limit (999)
_BUSY_TIMEOUT_MS = 30_000  # another process writing the same file: wait, do not fail


class CompletionLogError(RuntimeError):
    """The log cannot be used: not opened, already closed, or written by a newer artlike."""


class ReadLimitExceeded(ValueError):
    """A read would load more records or bytes than the caller allows (nothing was loaded)."""

    def __init__(self, message: str, *, records: int, stored_bytes: int) -> None:
        super().__init__(message)
        self.records = records
        self.stored_bytes = stored_bytes


@dataclass(frozen=True, slots=True)
class RetentionPolicy:
    """What `prune` removes: whole trajectories whose last completion is older than `max_age_seconds`, then
    the least recently used trajectories while the live data is over `max_bytes`. None: no limit."""

    max_age_seconds: float | None = None
    max_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class PruneResult:
    trajectories: int = 0
    completions: int = 0


@dataclass(frozen=True, slots=True)
class NewCompletion:
    """One choice of one completion, about to be recorded (a `CompletionRecord` without its row id)."""

    trajectory_id: str
    request_id: str
    choice_index: int
    endpoint: str
    model: str
    served_model: str
    step: int | None
    request: bytes
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    logprobs: Sequence[float]
    finish_reason: str | None
    created_at: float
    latency_seconds: float


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    packed = array("i", token_ids)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def unpack_token_ids(blob: bytes) -> list[int]:
    unpacked = array("i")
    unpacked.frombytes(blob)
    if sys.byteorder == "big":
        unpacked.byteswap()
    return unpacked.tolist()


def pack_logprobs(logprobs: Sequence[float]) -> bytes:
    packed = array("d", logprobs)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def unpack_logprobs(blob: bytes) -> list[float]:
    unpacked = array("d")
    unpacked.frombytes(blob)
    if sys.byteorder == "big":
        unpacked.byteswap()
    return unpacked.tolist()


def _row(completion: NewCompletion, request_row: int) -> tuple[object, ...]:
    return (
        completion.trajectory_id,
        completion.request_id,
        completion.choice_index,
        completion.endpoint,
        completion.model,
        completion.served_model,
        completion.step,
        request_row,
        pack_token_ids(completion.prompt_token_ids),
        pack_token_ids(completion.output_token_ids),
        pack_logprobs(completion.logprobs),
        completion.finish_reason,
        completion.created_at,
        completion.latency_seconds,
    )


def _record(row: sqlite3.Row) -> CompletionRecord:
    return CompletionRecord(
        id=row[0],
        trajectory_id=row[1],
        request_id=row[2],
        choice_index=row[3],
        endpoint=row[4],
        model=row[5],
        served_model=row[6],
        step=row[7],
        request={} if row[8] is None else orjson.loads(row[8]),
        prompt_token_ids=unpack_token_ids(row[9]),
        output_token_ids=unpack_token_ids(row[10]),
        logprobs=unpack_logprobs(row[11]),
        finish_reason=row[12],
        created_at=row[13],
        latency_seconds=row[14],
    )


def _connect(path: Path, *, check_same_thread: bool = True) -> sqlite3.Connection:
    connection = sqlite3.connect(
        path, timeout=_BUSY_TIMEOUT_MS / 1000, isolation_level=None, check_same_thread=check_same_thread
    )
    connection.execute("PRAGMA journal_mode=WAL")
    connection.execute("PRAGMA synchronous=NORMAL")
    connection.execute(f"PRAGMA busy_timeout={_BUSY_TIMEOUT_MS}")
    return connection


def _migrate(connection: sqlite3.Connection, path: Path) -> None:
    connection.execute("BEGIN IMMEDIATE")
    try:
        version = connection.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise CompletionLogError(
                f"{path} has schema version {version}; this artlike understands up to {SCHEMA_VERSION}"
            )
        if version < SCHEMA_VERSION:
            for statement in _SCHEMA_V2 if version == 0 else _MIGRATE_V1_TO_V2:
                connection.execute(statement)
            connection.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            if version:
                logger.info("completion log %s migrated from schema version %d to %d", path, version, SCHEMA_VERSION)
        connection.execute("COMMIT")
    except BaseException:
        connection.execute("ROLLBACK")
        raise


def _insert(connection: sqlite3.Connection, completions: list[NewCompletion]) -> None:
    """Insert the choices of one submit; choices of the same request with the same body share one body row."""
    bodies: dict[tuple[str, str], list[tuple[bytes, int]]] = {}
    rows = []
    for completion in completions:
        key = (completion.trajectory_id, completion.request_id)
        known = bodies.setdefault(key, [])
        # `is` first: the choices of one request carry the same bytes object, so no comparison is made.
        request_row = next((row for body, row in known if body is completion.request), None)
        if request_row is None:
            request_row = next((row for body, row in known if body == completion.request), None)
        if request_row is None:
            cursor = connection.execute(
                _INSERT_REQUEST,
                (completion.trajectory_id, completion.request_id, completion.request, completion.created_at),
            )
            request_row = cursor.lastrowid
            assert request_row is not None
            known.append((completion.request, request_row))
        rows.append(_row(completion, request_row))
    connection.executemany(_INSERT, rows)


def _delete_trajectories(connection: sqlite3.Connection, trajectory_ids: Sequence[str]) -> int:
    """Delete every row of these trajectories (inside the caller's transaction); the completions deleted."""
    deleted = 0
    for start in range(0, len(trajectory_ids), _MAX_SQL_VARIABLES):
        chunk = list(trajectory_ids[start : start + _MAX_SQL_VARIABLES])
        placeholders = ", ".join("?" * len(chunk))
        deleted += connection.execute(
            f"DELETE FROM completions WHERE trajectory_id IN ({placeholders})", chunk
        ).rowcount
        connection.execute(f"DELETE FROM requests WHERE trajectory_id IN ({placeholders})", chunk)
    return deleted


def _live_bytes(connection: sqlite3.Connection) -> int:
    """Bytes of the database's pages in use (the file keeps its size; freed pages are reused by later writes)."""
    page_size = connection.execute("PRAGMA page_size").fetchone()[0]
    pages = connection.execute("PRAGMA page_count").fetchone()[0]
    free = connection.execute("PRAGMA freelist_count").fetchone()[0]
    return int((pages - free) * page_size)


_Batch = tuple[list[NewCompletion], "concurrent.futures.Future[None]"]
_STOP = None


class CompletionLog:
    """Durable, append-only log of recorded completions. `open()` before use, `close()` to flush and stop."""

    def __init__(self, path: Path | str, *, max_batch_rows: int = 1024) -> None:
        self.path = Path(path)
        self.max_batch_rows = max_batch_rows
        self._queue: SimpleQueue[_Batch | None] = SimpleQueue()
        self._writer: threading.Thread | None = None
        self._reader: sqlite3.Connection | None = None
        self._reader_lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------------------------------- lifecycle

    def open(self) -> None:
        if self._writer is not None:
            raise CompletionLogError("the completion log is already open")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._reader = _connect(self.path, check_same_thread=False)
        _migrate(self._reader, self.path)
        self._writer = threading.Thread(target=self._write_loop, name="artlike-completion-log", daemon=True)
        self._writer.start()

    def close(self) -> None:
        """Commit everything submitted so far, then stop the writer thread and close the connections."""
        if self._writer is None or self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._writer.join()
        with self._reader_lock:  # a read or prune still running in its thread finishes first
            if self._reader is not None:
                self._reader.close()
                self._reader = None

    def __enter__(self) -> CompletionLog:
        self.open()
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    @property
    def pending(self) -> int:
        """Batches submitted but not yet taken by the writer (for the metrics gauge)."""
        return self._queue.qsize()

    # ---------------------------------------------------------------------------------------- writes

    def submit(self, completions: Sequence[NewCompletion]) -> concurrent.futures.Future[None]:
        """Queue rows for the writer thread; never blocks. The future resolves once they are committed.

        Safe to call from a cancelled task (a client that disconnected mid-stream): nothing is awaited.
        """
        if self._writer is None or self._closed:
            raise CompletionLogError("the completion log is not open")
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._queue.put((list(completions), future))
        return future

    async def record(self, completions: Sequence[NewCompletion]) -> None:
        """Record rows and return once they are committed."""
        if completions:
            await asyncio.wrap_future(self.submit(completions))

    def _write_loop(self) -> None:
        connection = _connect(self.path)
        try:
            stopping = False
            while not stopping:
                batches: list[_Batch] = []
                rows = 0
                item = self._queue.get()
                while True:
                    if item is _STOP:
                        stopping = True
                        break
                    batches.append(item)
                    rows += len(item[0])
                    if rows >= self.max_batch_rows or self._queue.empty():
                        break
                    item = self._queue.get()
                if batches:
                    self._commit(connection, batches)
        finally:
            connection.close()

    @staticmethod
    def _commit(connection: sqlite3.Connection, batches: list[_Batch]) -> None:
        # A caller that stopped waiting (its request was cancelled) still gets its rows written; marking the
        # futures running first makes a later cancel() a no-op instead of a race with set_result().
        for _, future in batches:
            future.set_running_or_notify_cancel()
        try:
            connection.execute("BEGIN IMMEDIATE")
            try:
                for completions, _ in batches:
                    _insert(connection, completions)
                connection.execute("COMMIT")
            except BaseException:
                connection.execute("ROLLBACK")
                raise
        except Exception as exc:  # handed to every waiting caller; the writer keeps serving later batches
            logger.error("completion log: a batch of %d writes failed: %r", len(batches), exc)
            for _, future in batches:
                if not future.cancelled():
                    future.set_exception(exc)
            return
        for _, future in batches:
            if not future.cancelled():
                future.set_result(None)

    # ----------------------------------------------------------------------------------------- reads

    async def get(self, trajectory_id: str) -> list[CompletionRecord]:
        """The trajectory's completions in recording order (empty if it has none)."""
        return (await self.get_many([trajectory_id]))[trajectory_id]

    async def get_many(self, trajectory_ids: Iterable[str]) -> dict[str, list[CompletionRecord]]:
        """Completions of several trajectories in one read; every requested id is a key (maybe empty)."""
        ids = list(dict.fromkeys(trajectory_ids))
        return await asyncio.to_thread(self._read, ids, _SELECT, "c.", None, None)

    async def read_for_training(
        self, trajectory_ids: Iterable[str], *, max_records: int | None = None, max_bytes: int | None = None
    ) -> dict[str, list[CompletionRecord]]:
        """As `get_many`, without request bodies (`request` is `{}`), for building training sequences.

        Raises `ReadLimitExceeded` before loading anything when the trajectories hold more than `max_records`
        completions or more than `max_bytes` bytes of token ids and logprobs.
        """
        ids = list(dict.fromkeys(trajectory_ids))
        return await asyncio.to_thread(self._read, ids, _SELECT_FOR_TRAINING, "", max_records, max_bytes)

    def _read(
        self, trajectory_ids: list[str], select: str, prefix: str, max_records: int | None, max_bytes: int | None
    ) -> dict[str, list[CompletionRecord]]:
        result: dict[str, list[CompletionRecord]] = {tid: [] for tid in trajectory_ids}
        with self._reader_lock:
            if self._reader is None:
                raise CompletionLogError("the completion log is not open")
            # One read transaction: a consistent snapshot across all chunks of the id list.
            self._reader.execute("BEGIN")
            try:
                if max_records is not None or max_bytes is not None:
                    self._check_size(trajectory_ids, max_records, max_bytes)
                for start in range(0, len(trajectory_ids), _MAX_SQL_VARIABLES):
                    chunk = trajectory_ids[start : start + _MAX_SQL_VARIABLES]
                    placeholders = ", ".join("?" * len(chunk))
                    query = f"{select} WHERE {prefix}trajectory_id IN ({placeholders}) ORDER BY {prefix}id"
                    for row in self._reader.execute(query, chunk):
                        result[row[1]].append(_record(row))
            finally:
                self._reader.execute("COMMIT")
        return result

    def _check_size(self, trajectory_ids: list[str], max_records: int | None, max_bytes: int | None) -> None:
        assert self._reader is not None
        records = stored = 0
        for start in range(0, len(trajectory_ids), _MAX_SQL_VARIABLES):
            chunk = trajectory_ids[start : start + _MAX_SQL_VARIABLES]
            placeholders = ", ".join("?" * len(chunk))
            count, size = self._reader.execute(
                f"SELECT COUNT(*), COALESCE(SUM({_TOKEN_BYTES}), 0) FROM completions "
                f"WHERE trajectory_id IN ({placeholders})",
                chunk,
            ).fetchone()
            records, stored = records + count, stored + size
        if max_records is not None and records > max_records:
            raise ReadLimitExceeded(
                f"the trajectories hold {records} recorded completions, more than the limit of {max_records}",
                records=records, stored_bytes=stored,
            )
        if max_bytes is not None and stored > max_bytes:
            raise ReadLimitExceeded(
                f"the trajectories hold {stored} bytes of token ids and logprobs, more than the limit of "
                f"{max_bytes}",
                records=records, stored_bytes=stored,
            )

    async def read(self, work: Callable[[sqlite3.Connection], _T]) -> _T:
        """Run `work` on the reader connection in one read transaction, in a thread (browsing queries:
        `completion_queries.py`)."""
        return await asyncio.to_thread(self._read_with, work)

    def _read_with(self, work: Callable[[sqlite3.Connection], _T]) -> _T:
        with self._reader_lock:
            if self._reader is None:
                raise CompletionLogError("the completion log is not open")
            self._reader.execute("BEGIN")
            try:
                return work(self._reader)
            finally:
                self._reader.execute("COMMIT")

    # ------------------------------------------------------------------------------------- retention

    async def delete_trajectory(self, trajectory_id: str) -> int:
        """Delete a trajectory's completions and request bodies; the number of completions deleted."""
        return await asyncio.to_thread(self._in_transaction, _delete_trajectories, [trajectory_id])

    async def prune(self, policy: RetentionPolicy, *, now: float | None = None) -> PruneResult:
        """Apply `policy` (whole trajectories, least recently used first); runs in a thread."""
        return await asyncio.to_thread(self.prune_sync, policy, now=now)

    def prune_sync(self, policy: RetentionPolicy, *, now: float | None = None) -> PruneResult:
        if policy.max_age_seconds is None and policy.max_bytes is None:
            return PruneResult()
        return self._in_transaction(self._prune, policy, time.time() if now is None else now)

    async def live_bytes(self) -> int:
        """Bytes of the log's pages in use."""
        return await asyncio.to_thread(self._in_transaction, _live_bytes)

    def _prune(self, connection: sqlite3.Connection, policy: RetentionPolicy, now: float) -> PruneResult:
        doomed: list[str] = []
        if policy.max_age_seconds is not None:
            cutoff = now - policy.max_age_seconds
            doomed = [row[0] for row in connection.execute(
                "SELECT trajectory_id FROM completions GROUP BY trajectory_id HAVING MAX(created_at) < ?",
                (cutoff,),
            )]
        completions = _delete_trajectories(connection, doomed)
        if policy.max_bytes is not None and (excess := _live_bytes(connection) - policy.max_bytes) > 0:
            # Least recently used first, until the stored bytes removed cover the excess.
            by_age = connection.execute(
                f"SELECT c.trajectory_id, SUM({_TOKEN_BYTES}) + COALESCE((SELECT SUM(length(body)) FROM requests "
                "AS r WHERE r.trajectory_id = c.trajectory_id), 0) FROM completions AS c "
                "GROUP BY c.trajectory_id ORDER BY MAX(c.created_at)"
            ).fetchall()
            oldest: list[str] = []
            for trajectory_id, size in by_age:
                if excess <= 0:
                    break
                oldest.append(trajectory_id)
                excess -= size
            completions += _delete_trajectories(connection, oldest)
            doomed += oldest
        if doomed:
            logger.info("completion log: pruned %d trajectories (%d completions)", len(doomed), completions)
        return PruneResult(trajectories=len(doomed), completions=completions)

    def _in_transaction(self, work: Callable[..., _T], *args: Any) -> _T:
        """Run `work(connection, *args)` in one write transaction on the reader connection (in a thread).

        The writer thread keeps its own connection; SQLite serialises the two (busy timeout), and a
        deleted trajectory's rows written later simply start it again.
        """
        with self._reader_lock:
            if self._reader is None:
                raise CompletionLogError("the completion log is not open")
            self._reader.execute("BEGIN IMMEDIATE")
            try:
                result = work(self._reader, *args)
            except BaseException:
                self._reader.execute("ROLLBACK")
                raise
            self._reader.execute("COMMIT")
            return result


async def prune_periodically(
    log: CompletionLog,
    policy: RetentionPolicy,
    interval_s: float,
    on_pruned: Callable[[PruneResult], None] | None = None,
) -> None:
    """Apply `policy` now and every `interval_s` seconds until cancelled (the app's lifespan owns the task).

    The SQLite work runs in a thread; a failed prune is logged with its traceback and retried next time.
    `on_pruned` is called after each successful prune.
    """
    while True:
        try:
            result = await log.prune(policy)
            if on_pruned is not None:
                on_pruned(result)
        except CompletionLogError:
            return  # closed: the server is stopping
        except Exception:
            logger.exception("completion log: pruning failed; next try in %.0f s", interval_s)
        await asyncio.sleep(interval_s)
