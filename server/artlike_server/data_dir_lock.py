"""One server per data dir: an exclusive `flock` on `<data_dir>/server.lock`, held for the process's life.

Two servers on one data dir would both write steps, history and the completion log. The lock file holds
the owner's pid so the second server can say who has it. flock (not the pid alone) decides: the kernel
drops the lock when its holder dies however it dies, so a stale pid in the file never blocks a start.
The descriptor is not inherited by the engine or the trainer (Python opens files non-inheritable).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_NAME = "server.lock"


class DataDirInUse(RuntimeError):
    """Another process holds the data dir's lock; `pid` is the pid it wrote (None if unreadable)."""

    def __init__(self, data_dir: Path, pid: int | None) -> None:
        holder = f"process {pid}" if pid is not None else "another process"
        super().__init__(f"data dir {data_dir} is in use by another artlike server ({holder}); stop it or "
                         "pass a different --data-dir")
        self.data_dir = data_dir
        self.pid = pid


class DataDirLock:
    """Held from `acquire()` until `release()` (or the process's end)."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.path = data_dir / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> DataDirLock:
        """Take the lock and write this process's pid into it; DataDirInUse at once if it is taken."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _read_pid(fd)
            os.close(fd)
            raise DataDirInUse(self.data_dir, pid) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None

    def __enter__(self) -> DataDirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_pid(fd: int) -> int | None:
    try:
        return int(os.pread(fd, 32, 0).decode().strip())
    except ValueError:  # empty: the holder is between flock and writing its pid
        return None
