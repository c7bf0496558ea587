"""Append-only JSONL files that survive a torn write.

A crash, a power loss or a full disk can leave a JSONL file's last line half-written, without its newline.
Appending straight after it would glue the next record onto the torn bytes: the pair parses as neither, and
a record that was written and fsynced reads as missing. `append_jsonl` fences a torn tail instead: when the
file does not end in a newline, the record goes out as "\\n" + line, in one write. The torn bytes stay, as
one line that `read_jsonl` skips with a warning.

Why a fence and not truncating back to the last newline: truncating destroys bytes on a guess. A tail
without its newline may be a complete record whose newline alone was lost (it parses, and counts), or
bytes worth keeping to see what happened; the fence loses nothing and costs one byte.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

import orjson

from .fsync import fsync_directory

log = logging.getLogger(__name__)

# (file, line number) of unparseable lines already reported: a torn line stays in the file, and some files
# are read on every request, so each is logged once per process.
_reported: set[tuple[str, int]] = set()
_reported_lock = threading.Lock()


def append_jsonl(path: Path, record: Any) -> None:
    """Append `record` as one JSON line and fsync it (the directory too when this creates the file)."""
    line = orjson.dumps(record) + b"\n"
    created = not path.exists()
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            line = b"\n" + line  # fence a torn tail: the record starts on a line of its own
        view = memoryview(line)
        while view:  # a short write is possible (a signal, a nearly full disk); the rest follows it
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    if created:
        fsync_directory(path.parent)


def read_jsonl(path: Path) -> list[Any]:
    """Every parseable line of `path` ([] when it does not exist); a line that is not JSON (a torn write)
    is skipped with a warning, never an error, so one bad line cannot hide the records around it."""
    try:
        content = path.read_bytes()
    except FileNotFoundError:
        return []
    records = []
    for number, line in enumerate(content.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            records.append(orjson.loads(line))
        except orjson.JSONDecodeError:
            _report(path, number, len(line))
    return records


def _report(path: Path, number: int, length: int) -> None:
    key = (str(path), number)
    with _reported_lock:
        if key in _reported:
            return
        _reported.add(key)
    log.warning("%s: skipping line %d (%d bytes): not JSON, most likely a write cut short by a crash",
                path, number, length)
