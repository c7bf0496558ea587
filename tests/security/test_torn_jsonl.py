"""A torn write never deletes a committed step: after a crash leaves half a history line, the next commit
still starts a line of its own, so a restart finds it committed and keeps the step. The helper itself:
fence, never truncate, and skip (with a warning) what does not parse."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from artlike_server.jsonl_append import append_jsonl, read_jsonl
from artlike_server.models.manager import ModelManager
from artlike_server.models.store import ModelStore

from artlike.types import LoraConfig
from tests.unit.test_model_manager import FakeEngine, add_step

TORN = b'{"step": 2, "rew'


def tear(path: Path) -> None:
    with open(path, "ab") as handle:
        handle.write(TORN)


def test_append_after_a_torn_tail_starts_a_new_line(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    append_jsonl(path, {"n": 1})
    tear(path)
    append_jsonl(path, {"n": 2})
    append_jsonl(path, {"n": 3})
    assert path.read_bytes() == b'{"n":1}\n' + TORN + b'\n{"n":2}\n{"n":3}\n'  # the torn bytes are kept
    assert read_jsonl(path) == [{"n": 1}, {"n": 2}, {"n": 3}]


@pytest.mark.parametrize("tail", [
    b"\0\0\0\0",  # a power loss after the size grew but before the data reached the disk
    b'{"n": 1}',  # a complete record whose newline alone was lost: it still counts
    b"\n\n",  # blank lines are no records
])
def test_other_tails(tmp_path: Path, tail: bytes) -> None:
    path = tmp_path / "log.jsonl"
    path.write_bytes(tail)
    append_jsonl(path, {"n": 2})
    expected = [{"n": 1}] if tail.startswith(b"{") else []
    assert read_jsonl(path) == [*expected, {"n": 2}]
    assert path.read_bytes().startswith(tail)  # never truncated


def test_unparseable_lines_are_skipped_with_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "log.jsonl"
    path.write_bytes(b'{"n": 1}\n' + TORN + b'\n{"n": 2}\n')
    with caplog.at_level(logging.WARNING, logger="artlike_server.jsonl_append"):
        assert read_jsonl(path) == [{"n": 1}, {"n": 2}]
        assert read_jsonl(path) == [{"n": 1}, {"n": 2}]
    warnings = [r.getMessage() for r in caplog.records if r.name == "artlike_server.jsonl_append"]
    assert len(warnings) == 1 and "line 2" in warnings[0], warnings  # once per line, not per read
    assert read_jsonl(tmp_path / "missing.jsonl") == []


def test_a_new_file_and_its_directory_are_fsynced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    path = tmp_path.resolve() / "log.jsonl"
    append_jsonl(path, {"n": 1})
    assert synced == [str(path), str(path.parent)]
    append_jsonl(path, {"n": 2})
    assert synced[2:] == [str(path)]  # an existing file's name is durable already


def committed_model(tmp_path: Path) -> ModelStore:
    store = ModelStore(tmp_path)
    for step in (0, 1):
        add_step(store, "m", step)
    store.create("m", "base", LoraConfig())
    return store


async def test_a_step_committed_after_a_torn_line_survives_a_restart(tmp_path: Path) -> None:
    store = committed_model(tmp_path)
    add_step(store, "m", 2, committed=False)
    tear(store.model_dir("m") / "history.jsonl")  # the crash: step 2's history line is half-written
    first_start = ModelManager(ModelStore(tmp_path), FakeEngine(), "base")  # type: ignore[arg-type]
    await first_start.restore()
    assert store.steps("m") == [0, 1]  # the uncommitted step is removed, as it should be
    add_step(store, "m", 3)  # the next step is trained and committed (its history line fsynced)

    restarted = ModelStore(tmp_path)  # a new process reads everything back from disk
    assert [entry["step"] for entry in restarted.read_history("m")] == [1, 3]
    assert (restarted.committed_steps("m"), restarted.uncommitted_steps("m")) == ([0, 1, 3], [])
    engine = FakeEngine()
    await ModelManager(restarted, engine, "base").restore()  # type: ignore[arg-type]
    assert restarted.steps("m") == [0, 1, 3]
    assert list(engine.loaded) == ["m@3"]
