"""Uploaded files (`/v1/files`), stored once per content under the data dir.

Blobs live at `files/blobs/<sha256>`, written to a temporary name, fsynced and renamed into place (the
directory fsynced too) before their row commits, so a crash never leaves half a file, nor a row without its
blob; metadata in `files/files.sqlite`. Two uploads of the same bytes share one blob, which is deleted with
its last file: publishing a blob with its row, and deleting a row with its blob, each happen under the
store's lock, so a delete never removes the blob of a file being created with the same content. Files for training (`fine-tune`, `reinforcement-fine-tune`) must be UTF-8 JSONL
of objects: a bad line is a 400 naming it, at upload, not when a job starts.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import orjson

from ..errors import InvalidRequest, NotFound, PayloadTooLarge
from ..fsync import fsync_directory

PURPOSES = frozenset({"fine-tune", "reinforcement-fine-tune", "evals", "user_data", "batch", "assistants", "vision"})
JSONL_PURPOSES = frozenset({"fine-tune", "reinforcement-fine-tune"})

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY,
    created_at INTEGER NOT NULL,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    sha256 TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS files_created ON files (created_at, id);
CREATE INDEX IF NOT EXISTS files_blob ON files (sha256);
"""


@dataclass(frozen=True)
class FileLimits:
    max_bytes: int = 256 << 20
    max_lines: int = 1_000_000


@dataclass(frozen=True)
class StoredFile:
    id: str
    created_at: int
    filename: str
    purpose: str
    bytes: int
    sha256: str

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed"}


def check_jsonl(content: bytes, *, max_lines: int) -> int:
    """Lines of a training file: UTF-8 JSONL, each non-blank line an object. Raises InvalidRequest naming the line."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InvalidRequest(f"the file is not UTF-8 (byte {error.start})", param="file", code="invalid_file") from error
    lines = 0
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        lines += 1
        if lines > max_lines:
            raise PayloadTooLarge(f"the file has more than {max_lines} lines", param="file", code="file_too_large")
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError as error:
            raise InvalidRequest(f"line {number}: not valid JSON ({error})", param="file", code="invalid_file") from error
        if not isinstance(row, dict):
            raise InvalidRequest(f"line {number}: each line must be a JSON object", param="file", code="invalid_file")
    if lines == 0:
        raise InvalidRequest("the file has no rows", param="file", code="invalid_file")
    return lines


class FileStore:
    def __init__(self, root: Path, limits: FileLimits = FileLimits()) -> None:
        self.root = root
        self.limits = limits
        (root / "blobs").mkdir(parents=True, exist_ok=True)
        for leftover in (root / "blobs").glob(".*"):  # temporaries of uploads a crash cut short
            leftover.unlink(missing_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(root / "files.sqlite", check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        # Every commit on disk before it returns: a deleted row's blob is unlinked only after.
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def create(self, content: bytes, filename: str, purpose: str) -> StoredFile:
        if purpose not in PURPOSES:
            raise InvalidRequest(f"purpose must be one of {', '.join(sorted(PURPOSES))}, not {purpose!r}",
                                 param="purpose", code="invalid_purpose")
        if len(content) > self.limits.max_bytes:
            raise PayloadTooLarge(f"the file is {len(content)} bytes; at most {self.limits.max_bytes} are accepted",
                                  param="file", code="file_too_large")
        if purpose in JSONL_PURPOSES:
            check_jsonl(content, max_lines=self.limits.max_lines)
        digest = hashlib.sha256(content).hexdigest()
        stored = StoredFile(f"file-{secrets.token_hex(12)}", int(time.time()), filename or "upload.jsonl", purpose,
                            len(content), digest)
        staged = self._stage(content, digest)
        try:
            with self._lock:
                self._publish(content, digest, staged)
                self._db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?)",
                                 (stored.id, stored.created_at, stored.filename, stored.purpose, stored.bytes,
                                  stored.sha256))
        finally:
            if staged is not None:
                staged.unlink(missing_ok=True)  # gone once renamed into place; left when the blob was there
        return stored

    def _blob(self, digest: str) -> Path:
        return self.root / "blobs" / digest

    def _stage(self, content: bytes, digest: str) -> Path | None:
        """A durable temporary copy of a blob not stored yet, written outside the lock (the slow part of an
        upload); None when the blob is there already."""
        return None if self._blob(digest).exists() else self._write_temporary(content, digest)

    def _write_temporary(self, content: bytes, digest: str) -> Path:
        temporary = self._blob(digest).with_name(f".{digest}.{secrets.token_hex(4)}")
        try:
            with open(temporary, "xb") as handle:
                handle.write(content)
                handle.flush()
                os.fsync(handle.fileno())
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        return temporary

    def _publish(self, content: bytes, digest: str, staged: Path | None) -> None:
        """Under the lock, before the row commits: the blob in place and on disk. A delete may have removed
        it since `_stage` looked (its last file went): then it is written again, here."""
        blob = self._blob(digest)
        if blob.exists():
            return
        if staged is None:
            staged = self._write_temporary(content, digest)
        try:
            os.replace(staged, blob)
        except BaseException:
            staged.unlink(missing_ok=True)
            raise
        fsync_directory(blob.parent)

    def get(self, file_id: str) -> StoredFile:
        with self._lock:
            row = self._db.execute("SELECT * FROM files WHERE id = ?", (file_id,)).fetchone()
        if row is None:
            raise NotFound(f"no file {file_id!r}", param="file_id", code="file_not_found")
        return StoredFile(*row)

    def read(self, file_id: str) -> bytes:
        try:
            return self._blob(self.get(file_id).sha256).read_bytes()
        except FileNotFoundError:  # the file was deleted after `get` found it
            raise NotFound(f"no file {file_id!r}", param="file_id", code="file_not_found") from None

    def page(self, *, purpose: str | None = None, limit: int = 10_000, after: str | None = None,
             order: Literal["asc", "desc"] = "desc") -> tuple[list[StoredFile], bool]:
        query, params = "SELECT * FROM files", []  # type: tuple[str, list[Any]]
        clauses = []
        if purpose is not None:
            clauses.append("purpose = ?")
            params.append(purpose)
        if after is not None:
            anchor = self.get(after)
            clauses.append("(created_at, id) < (?, ?)" if order == "desc" else "(created_at, id) > (?, ?)")
            params += [anchor.created_at, anchor.id]
        if clauses:
            query += " WHERE " + " AND ".join(clauses)
        direction = "DESC" if order == "desc" else "ASC"
        query += f" ORDER BY created_at {direction}, id {direction} LIMIT ?"
        params.append(limit + 1)
        with self._lock:
            rows = self._db.execute(query, params).fetchall()
        files = [StoredFile(*r) for r in rows]
        return files[:limit], len(files) > limit

    def delete(self, file_id: str) -> None:
        # Row and blob under one lock: a create of the same content either committed its row before (the
        # blob is kept for it) or publishes the blob again after.
        with self._lock:
            row = self._db.execute("SELECT sha256 FROM files WHERE id = ?", (file_id,)).fetchone()
            if row is None:
                raise NotFound(f"no file {file_id!r}", param="file_id", code="file_not_found")
            self._db.execute("DELETE FROM files WHERE id = ?", (file_id,))
            shared = self._db.execute("SELECT 1 FROM files WHERE sha256 = ? LIMIT 1", (row[0],)).fetchone()
            if shared is None:  # the row's removal is committed first: a crash leaves a blob, never a lost one
                self._blob(row[0]).unlink(missing_ok=True)
