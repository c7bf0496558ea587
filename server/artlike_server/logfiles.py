"""Size-bounded log files for the child processes (`engine.log`, `trainer.log`).

`RotatingLog` appends bytes and rotates by size: `engine.log` -> `engine.log.1` -> ... -> `engine.log.N`,
the oldest dropped, so a log uses at most about (backups + 1) x max_bytes. It writes whole chunks, never
splitting one, so a file may exceed max_bytes by one chunk (at most `PUMP_CHUNK_BYTES` from `pump`).

Why a pipe and a reader, not the child writing to the file: a child that writes to an inherited file
descriptor can grow the file forever (rotating means renaming, and the child keeps writing the renamed
file). So the child's stdout/stderr is a pipe and `pump` — a plain thread, off the event loop — copies
it into a `RotatingLog`. The cost is one thread per child and one copy of its output.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

PUMP_CHUNK_BYTES = 64 * 1024


class RotatingLog:
    """An append-only byte log rotated at `max_bytes`, keeping `backups` old files; thread-safe."""

    def __init__(self, path: Path, *, max_bytes: int, backups: int) -> None:
        if max_bytes <= 0 or backups < 1:
            raise ValueError("max_bytes must be positive and backups at least 1")
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self._lock = threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("ab")
        self._size = self._file.tell()

    def write(self, data: bytes) -> None:
        """Append `data` and flush (a crash keeps what was written); rotate first if it would not fit."""
        with self._lock:
            if self._file.closed:
                return
            if self._size and self._size + len(data) > self.max_bytes:
                self._rotate()
            self._file.write(data)
            self._file.flush()
            self._size += len(data)

    def close(self) -> None:
        with self._lock:
            self._file.close()

    def _rotate(self) -> None:
        self._file.close()
        for index in range(self.backups - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{index}")
            if older.exists():
                os.replace(older, self.path.with_name(f"{self.path.name}.{index + 1}"))
        os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        self._file = self.path.open("ab")
        self._size = 0


def pump(read_fd: int, log: RotatingLog, *, name: str, on_eof: Callable[[], None] | None = None) -> threading.Thread:
    """Copy everything from `read_fd` into `log` in a daemon thread until EOF (every writer closed), then
    close `read_fd` and call `on_eof`. The caller must close its own copy of the write end."""

    def run() -> None:
        try:
            while data := os.read(read_fd, PUMP_CHUNK_BYTES):
                log.write(data)
        finally:
            os.close(read_fd)
            if on_eof is not None:
                on_eof()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread
