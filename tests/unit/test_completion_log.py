"""The completion log: round trip, many trajectories at once, concurrent writers, failures, crash safety."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from artlike_server.completion_log import (
    SCHEMA_VERSION,
    CompletionLog,
    CompletionLogError,
    NewCompletion,
    PruneResult,
    ReadLimitExceeded,
    RetentionPolicy,
    pack_logprobs,
    pack_token_ids,
    prune_periodically,
    unpack_logprobs,
    unpack_token_ids,
)


def completion(
    trajectory_id: str, *, request_id: str = "chatcmpl-1", choice: int = 0, tokens: int = 5
) -> NewCompletion:
    rng = np.random.default_rng(zlib.crc32(f"{trajectory_id}/{request_id}/{choice}".encode()))
    return NewCompletion(
        trajectory_id=trajectory_id,
        request_id=request_id,
        choice_index=choice,
        endpoint="chat.completions",
        model="agent",
        served_model="agent@3",
        step=3,
        request=orjson.dumps({"model": "agent", "messages": [{"role": "user", "content": "hi"}], "n": 2}),
        prompt_token_ids=rng.integers(0, 49152, 12).tolist(),
        output_token_ids=rng.integers(0, 49152, tokens).tolist(),
        # float32 values, as the engine computes them: they must come back bit-exact
        logprobs=[float(v) for v in -rng.random(tokens, dtype=np.float32) * 10],
        finish_reason="stop",
        created_at=1_700_000_000.25,
        latency_seconds=0.5,
    )


@pytest.fixture
def log(tmp_path: Path) -> Iterator[CompletionLog]:
    opened = CompletionLog(tmp_path / "data" / "completions.sqlite")
    opened.open()
    yield opened
    opened.close()


def test_packing_round_trips() -> None:
    ids = [0, 1, 49151, 2**31 - 1]
    assert unpack_token_ids(pack_token_ids(ids)) == ids
    assert len(pack_token_ids(ids)) == 16
    logprobs = [-0.0, -1e-9, -23.5, float(np.float32(-2.357936143875122))]
    assert unpack_logprobs(pack_logprobs(logprobs)) == logprobs


async def test_round_trip(log: CompletionLog) -> None:
    written = [completion("traj-a", choice=0), completion("traj-a", choice=1, tokens=0)]
    await log.record(written)
    records = await log.get("traj-a")
    assert [r.choice_index for r in records] == [0, 1]
    for new, stored in zip(written, records, strict=True):
        assert stored.trajectory_id == new.trajectory_id and stored.request_id == new.request_id
        assert (stored.endpoint, stored.model, stored.served_model, stored.step) == (
            "chat.completions",
            "agent",
            "agent@3",
            3,
        )
        assert stored.request == orjson.loads(new.request)
        assert stored.prompt_token_ids == new.prompt_token_ids
        assert stored.output_token_ids == new.output_token_ids
        assert stored.logprobs == new.logprobs
        assert (stored.finish_reason, stored.created_at, stored.latency_seconds) == (
            "stop",
            1_700_000_000.25,
            0.5,
        )
    assert records[0].id < records[1].id
    assert await log.get("traj-unknown") == []


async def test_get_many_reads_many_trajectories_in_order(log: CompletionLog) -> None:
    ids = [f"traj-{i}" for i in range(1200)]  # more than one SQL statement's worth of variables
    await log.record([completion(tid, request_id=f"r{k}") for k in range(2) for tid in ids])
    result = await log.get_many([*ids, "missing", ids[0]])
    assert list(result) == [*ids, "missing"]
    assert result["missing"] == []
    assert all([r.request_id for r in result[tid]] == ["r0", "r1"] for tid in ids)


async def test_concurrent_writers(tmp_path: Path) -> None:
    """Many concurrent requests through one log, while a second log on the same file writes from a thread
    (as a second server process would): every row lands exactly once."""
    path = tmp_path / "completions.sqlite"
    first, second = CompletionLog(path), CompletionLog(path)
    first.open()
    second.open()
    try:

        def other_writer() -> None:
            for k in range(100):
                second.submit([completion("other", request_id=f"o{k}")]).result(timeout=60)

        thread = threading.Thread(target=other_writer)
        thread.start()
        await asyncio.gather(
            *(first.record([completion(f"t{k % 10}", request_id=f"r{k}")]) for k in range(300))
        )
        await asyncio.to_thread(thread.join)
        everything = await first.get_many([*(f"t{k}" for k in range(10)), "other"])
        assert sorted(r.request_id for k in range(10) for r in everything[f"t{k}"]) == sorted(
            f"r{k}" for k in range(300)
        )
        assert [r.request_id for r in everything["other"]] == [f"o{k}" for k in range(100)]
        row_ids = [r.id for rows in everything.values() for r in rows]
        assert len(set(row_ids)) == 400
    finally:
        first.close()
        second.close()


async def test_a_failed_write_reaches_the_caller_and_the_writer_goes_on(log: CompletionLog) -> None:
    good = completion("ok")
    bad = NewCompletion(
        trajectory_id="bad",
        request_id="r",
        choice_index=0,
        endpoint="chat.completions",
        model="m",
        served_model="m",
        step=None,
        request=b"{}",
        prompt_token_ids=[1],
        output_token_ids=[2**40],  # does not fit the int32 column encoding
        logprobs=[-1.0],
        finish_reason=None,
        created_at=0.0,
        latency_seconds=0.0,
    )
    with pytest.raises(OverflowError):
        await log.record([bad])
    await log.record([good])
    assert [r.trajectory_id for r in await log.get("ok")] == ["ok"]
    assert await log.get("bad") == []


async def test_rows_are_written_even_if_the_caller_stops_waiting(log: CompletionLog) -> None:
    waiting = asyncio.ensure_future(log.record([completion("cancelled")]))
    await asyncio.sleep(0)  # let it submit
    waiting.cancel()
    await log.record([completion("after")])  # FIFO: committed after the cancelled caller's rows
    assert len(await log.get("cancelled")) == 1


def test_lifecycle_errors(tmp_path: Path) -> None:
    log = CompletionLog(tmp_path / "c.sqlite")
    with pytest.raises(CompletionLogError):
        log.submit([completion("x")])
    with log, pytest.raises(CompletionLogError):
        log.open()
    with pytest.raises(CompletionLogError):
        log.submit([completion("x")])
    connection = sqlite3.connect(tmp_path / "c.sqlite")
    assert connection.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert connection.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    indexes = {row[1] for row in connection.execute("PRAGMA index_list(completions)")}
    assert "completions_by_trajectory" in indexes
    connection.execute("PRAGMA user_version=99")
    connection.close()
    with pytest.raises(CompletionLogError, match="schema version 99"):
        CompletionLog(tmp_path / "c.sqlite").open()


_WRITER = """
import sys
from tests.unit.test_completion_log import completion
from artlike_server.completion_log import CompletionLog

log = CompletionLog(sys.argv[1], max_batch_rows=100_000)
log.open()
batch = 0
while True:  # batches of 50 rows sharing one request id, as fast as possible, until killed
    futures = [log.submit([completion(f"t{batch}-{k}", request_id=f"b{batch}", tokens=200) for k in range(50)])]
    batch += 1
    if batch % 4 == 0:
        futures[-1].result()
        print(batch, flush=True)
"""


def test_kill_9_mid_batch_leaves_a_consistent_database(tmp_path: Path) -> None:
    path = tmp_path / "completions.sqlite"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(path)],
        stdout=subprocess.PIPE,
        cwd=Path(__file__).parents[2],
        env=env,
        text=True,
    )
    try:
        assert writer.stdout is not None
        for _ in range(3):  # a few commits in, while it keeps writing
            assert writer.stdout.readline(), "the writer process died"
        os.kill(writer.pid, signal.SIGKILL)
        assert writer.wait(timeout=30) == -signal.SIGKILL
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()

    connection = sqlite3.connect(path)
    assert connection.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    per_request = connection.execute(
        "SELECT request_id, count(*) FROM completions GROUP BY request_id"
    ).fetchall()
    assert len(per_request) >= 12
    assert all(count == 50 for _, count in per_request)  # each batch is all or nothing
    connection.close()

    reopened = CompletionLog(path)
    reopened.open()
    try:
        (row,) = asyncio.run(reopened.get_many(["t0-0"]))["t0-0"]
        assert len(row.output_token_ids) == len(row.logprobs) == 200
        assert row.output_token_ids == completion("t0-0", request_id="b0", tokens=200).output_token_ids
    finally:
        reopened.close()


# ------------------------------------------------------------------------- schema 2, retention, caps

V1_FILE = Path(__file__).parent / "data" / "completions_v1.sqlite"
"""Written by the schema-1 code (artlike f020d0c): traj-a has a request with 3 choices and one with 1 choice,
traj-b one request whose body equals traj-a's second body. Kept as it was written, never rewritten."""


def test_a_version_1_log_is_migrated_with_its_rows_and_bodies_stored_once(tmp_path: Path) -> None:
    path = tmp_path / "completions.sqlite"
    path.write_bytes(V1_FILE.read_bytes())

    async def read() -> dict[str, list[Any]]:
        with CompletionLog(path) as log:
            return await log.get_many(["traj-a", "traj-b"])

    records = asyncio.run(read())

    assert [(r.request_id, r.choice_index) for r in records["traj-a"]] == [
        ("chatcmpl-a1", 0), ("chatcmpl-a1", 1), ("chatcmpl-a1", 2), ("chatcmpl-a2", 0)]
    assert records["traj-a"][2].request["messages"][0]["content"] == "three choices"
    assert records["traj-a"][2].prompt_token_ids == [1, 2, 3, 2]
    assert records["traj-a"][2].logprobs == [-2.5, -0.125]
    assert records["traj-b"][0].request["messages"][0]["content"] == "one choice"
    with sqlite3.connect(path) as connection:
        assert connection.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 2
        # one body per request (traj-b's equal body is its own request), not one per choice
        assert connection.execute("SELECT COUNT(*) FROM requests").fetchone()[0] == 3


def test_the_choices_of_one_request_store_its_body_once(log: CompletionLog) -> None:
    big = orjson.dumps({"model": "agent", "messages": [], "n": 16, "unknown": "x" * 1_000_000})
    rows = [dataclasses.replace(completion("t1", choice=i), request=big) for i in range(16)]
    before = asyncio.run(log.live_bytes())

    asyncio.run(log.record(rows))

    growth = asyncio.run(log.live_bytes()) - before
    assert 0.9 * len(big) < growth < 1.2 * len(big)  # 16 copies before schema 2
    records = asyncio.run(log.get("t1"))
    assert [r.choice_index for r in records] == list(range(16))
    assert all(len(r.request["unknown"]) == 1_000_000 for r in records)


def test_delete_trajectory_removes_its_completions_and_bodies_only(log: CompletionLog, tmp_path: Path) -> None:
    asyncio.run(log.record([completion("t1", choice=0), completion("t1", choice=1), completion("t2")]))

    assert asyncio.run(log.delete_trajectory("t1")) == 2
    assert asyncio.run(log.delete_trajectory("t1")) == 0

    assert asyncio.run(log.get("t1")) == []
    assert len(asyncio.run(log.get("t2"))) == 1
    with sqlite3.connect(log.path) as connection:
        assert connection.execute("SELECT trajectory_id FROM requests").fetchall() == [("t2",)]


def at(row: NewCompletion, created_at: float) -> NewCompletion:
    return dataclasses.replace(row, created_at=created_at)


def test_prune_by_age_removes_whole_trajectories_whose_last_completion_is_old(log: CompletionLog) -> None:
    now = 1_800_000_000.0
    asyncio.run(log.record([at(completion("old"), now - 100), at(completion("old", request_id="r2"), now - 90),
                            at(completion("mixed"), now - 100), at(completion("mixed", request_id="r2"), now - 5),
                            at(completion("new"), now - 1)]))

    result = asyncio.run(log.prune(RetentionPolicy(max_age_seconds=50), now=now))

    assert (result.trajectories, result.completions) == (1, 2)
    remaining = asyncio.run(log.get_many(["old", "mixed", "new"]))
    assert {k: len(v) for k, v in remaining.items()} == {"old": 0, "mixed": 2, "new": 1}


def test_prune_by_size_removes_least_recently_used_trajectories_first(log: CompletionLog) -> None:
    body = orjson.dumps({"pad": "y" * 200_000})
    asyncio.run(log.record([dataclasses.replace(at(completion(f"t{i}"), 1000.0 + i), request=body)
                            for i in range(5)]))
    live = asyncio.run(log.live_bytes())

    result = asyncio.run(log.prune(RetentionPolicy(max_bytes=live - 300_000)))

    assert result.trajectories == 2  # each holds ~200 KB: two make room
    remaining = asyncio.run(log.get_many([f"t{i}" for i in range(5)]))
    assert [tid for tid, rows in remaining.items() if rows] == ["t2", "t3", "t4"]
    assert asyncio.run(log.live_bytes()) <= live - 300_000


def test_the_default_policy_prunes_nothing(log: CompletionLog) -> None:
    asyncio.run(log.record([at(completion("ancient"), 0.0)]))
    assert asyncio.run(log.prune(RetentionPolicy())) == PruneResult()
    assert len(asyncio.run(log.get("ancient"))) == 1


def test_read_for_training_refuses_too_many_records_or_bytes_before_loading(log: CompletionLog) -> None:
    asyncio.run(log.record([completion("t1", choice=i, tokens=100) for i in range(4)]))

    with pytest.raises(ReadLimitExceeded, match="4 recorded completions, more than the limit of 3"):
        asyncio.run(log.read_for_training(["t1"], max_records=3))
    with pytest.raises(ReadLimitExceeded, match="more than the limit of 1000"):
        asyncio.run(log.read_for_training(["t1"], max_bytes=1000))
    records = asyncio.run(log.read_for_training(["t1"], max_records=4, max_bytes=10_000))
    assert [r.request for r in records["t1"]] == [{}] * 4  # bodies are not loaded for training
    assert records["t1"][3].output_token_ids == completion("t1", choice=3, tokens=100).output_token_ids


async def test_the_periodic_prune_runs_at_once_and_stops_when_cancelled(tmp_path: Path) -> None:
    with CompletionLog(tmp_path / "completions.sqlite") as log:
        await log.record([at(completion("old"), 0.0), at(completion("recent"), time.time())])
        results: list[PruneResult] = []
        pruned = asyncio.Event()

        def on_pruned(result: PruneResult) -> None:
            results.append(result)
            pruned.set()

        task = asyncio.create_task(
            prune_periodically(log, RetentionPolicy(max_age_seconds=86_400), 3600, on_pruned=on_pruned))
        await asyncio.wait_for(pruned.wait(), 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert results == [PruneResult(trajectories=1, completions=1)]
        assert await log.get("old") == [] and len(await log.get("recent")) == 1
