"""Child-process logs are bounded: `RotatingLog` rotates by size and keeps N backups; `pump` copies a pipe."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from artlike_server.logfiles import RotatingLog, pump


def test_rotation_keeps_the_newest_bytes_in_at_most_backups_plus_one_files(tmp_path: Path) -> None:
    log = RotatingLog(tmp_path / "trainer.log", max_bytes=100, backups=2)
    for index in range(10):
        log.write(f"line {index} ".encode() + b"x" * 33 + b"\n")  # 41 bytes: two per file
    log.close()

    assert sorted(p.name for p in tmp_path.iterdir()) == ["trainer.log", "trainer.log.1", "trainer.log.2"]
    assert (tmp_path / "trainer.log").read_bytes().startswith(b"line 8 ")
    assert (tmp_path / "trainer.log.1").read_bytes().startswith(b"line 6 ")
    assert (tmp_path / "trainer.log.2").read_bytes().startswith(b"line 4 ")
    assert all(p.stat().st_size <= 100 for p in tmp_path.iterdir())


def test_an_existing_log_counts_toward_the_limit(tmp_path: Path) -> None:
    (tmp_path / "engine.log").write_bytes(b"a" * 90)
    log = RotatingLog(tmp_path / "engine.log", max_bytes=100, backups=1)
    log.write(b"b" * 20)
    log.close()
    assert (tmp_path / "engine.log.1").read_bytes() == b"a" * 90
    assert (tmp_path / "engine.log").read_bytes() == b"b" * 20


def test_pump_copies_a_pipe_until_every_writer_closed_it(tmp_path: Path) -> None:
    log = RotatingLog(tmp_path / "engine.log", max_bytes=1 << 20, backups=1)
    read_fd, write_fd = os.pipe()
    drained = threading.Event()
    pump(read_fd, log, name="test-pump", on_eof=drained.set)
    os.write(write_fd, b"hello\n")
    os.write(write_fd, b"world\n")
    os.close(write_fd)
    assert drained.wait(10)
    assert (tmp_path / "engine.log").read_bytes() == b"hello\nworld\n"


def test_bad_limits_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        RotatingLog(tmp_path / "x.log", max_bytes=0, backups=1)
