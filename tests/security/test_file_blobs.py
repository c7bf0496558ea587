"""`/v1/files` blobs: on disk (file and directory fsynced) before their row commits, and never removed under
a file that still needs them: deleting the last file of some content while a new file of the same content
is being created leaves the new file readable. The race is played step by step, not by timing."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from artlike_server.jobs.files import FileStore

CONTENT = b'{"prompt": "same bytes"}\n'


@pytest.fixture
def store(tmp_path: Path) -> Iterator[FileStore]:
    files = FileStore(tmp_path / "files")
    yield files
    files.close()


def test_blob_is_durable_before_its_row_commits(store: FileStore, monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        events.append("fsync " + os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    store._db.set_trace_callback(lambda sql: events.append(sql.split(" (")[0]))
    stored = store.create(CONTENT, "rows.jsonl", "fine-tune")
    store._db.set_trace_callback(None)

    blobs = store.root.resolve() / "blobs"
    insert = events.index("INSERT INTO files VALUES")
    written = [e for e in events[:insert] if e.startswith(f"fsync {blobs}/.{stored.sha256}.")]
    assert len(written) == 1, events  # the bytes, under their temporary name
    assert events.index(written[0]) < events.index(f"fsync {blobs}") < insert, events  # then the rename
    assert store.read(stored.id) == CONTENT
    assert [p.name for p in blobs.iterdir()] == [stored.sha256]  # no temporary left


def interleave(store: FileStore, monkeypatch: pytest.MonkeyPatch, step: Callable[[], None]) -> None:
    """Run `step` right after the next create has staged its blob and before it takes the lock to commit:
    the window where the old store decided the blob was there, then inserted a row for it."""
    stage = store._stage

    def stage_then_step(content: bytes, digest: str) -> Path | None:
        staged = stage(content, digest)
        monkeypatch.setattr(store, "_stage", stage)
        step()
        return staged

    monkeypatch.setattr(store, "_stage", stage_then_step)


def test_delete_of_the_last_twin_during_a_create_keeps_the_blob(store: FileStore,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    old = store.create(CONTENT, "old.jsonl", "fine-tune")
    interleave(store, monkeypatch, lambda: store.delete(old.id))  # removes the blob: `old` was its last file
    new = store.create(CONTENT, "new.jsonl", "fine-tune")
    assert store.read(new.id) == CONTENT
    assert [f.id for f in store.page()[0]] == [new.id]
    reopened = FileStore(store.root)
    assert reopened.read(new.id) == CONTENT
    reopened.close()


def test_delete_during_the_create_of_new_content_keeps_the_blob(store: FileStore,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    other = store.create(b'{"prompt": "other"}\n', "other.jsonl", "fine-tune")
    interleave(store, monkeypatch, lambda: store.delete(other.id))
    new = store.create(CONTENT, "new.jsonl", "fine-tune")
    assert store.read(new.id) == CONTENT
    assert [p.name for p in (store.root / "blobs").iterdir()] == [new.sha256]


def test_deletes_keep_a_blob_until_its_last_file_goes(store: FileStore) -> None:
    first = store.create(CONTENT, "a.jsonl", "fine-tune")
    second = store.create(CONTENT, "b.jsonl", "fine-tune")
    store.delete(first.id)
    assert store.read(second.id) == CONTENT
    store.delete(second.id)
    assert list((store.root / "blobs").iterdir()) == []


def test_temporaries_of_a_crashed_upload_are_removed_at_open(store: FileStore) -> None:
    kept = store.create(CONTENT, "a.jsonl", "fine-tune")
    (store.root / "blobs" / f".{kept.sha256}.dead").write_bytes(b"half")  # a crash between write and rename
    reopened = FileStore(store.root)
    assert [p.name for p in (store.root / "blobs").iterdir()] == [kept.sha256]
    assert reopened.read(kept.id) == CONTENT
    reopened.close()
