"""The completion log: round trip, many trajectories at once, concurrent writers, failures, crash safety."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import orjson
import pytest
from artlike_server.completion_log import (
    SCHEMA_VERSION,
    CompletionLog,
    CompletionLogError,
    NewCompletion,
    pack_logprobs,
    pack_token_ids,
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
