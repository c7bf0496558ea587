"""TrainerProcess's process handling (start, crash, silence, stale events) against small stand-in workers.

Each stand-in is a real executable speaking (part of) the worker protocol, passed as the `python` the
client launches; the real worker is exercised in tests/integration/test_trainer_worker.py.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
from artlike_server.training.trainer_client import (
    HEARTBEAT,
    TrainerCrashed,
    TrainerError,
    TrainerProcess,
    TrainerTimeout,
)

from artlike.types import TrainConfig


def stand_in(tmp_path: Path, body: str) -> str:
    """An executable that ignores the worker's command line and runs `body` (with `emit` and `commands`)."""
    script = tmp_path / "worker"
    script.write_text(
        f"#!{sys.executable}\n"
        + textwrap.dedent(
            """
            import json, sys, time
            def emit(event, id, **fields):
                print(json.dumps({"event": event, "id": id, **fields}), flush=True)
            def commands():
                for line in sys.stdin:
                    yield json.loads(line)
            """
        )
        + textwrap.dedent(body)
    )
    script.chmod(0o755)
    return str(script)


def trainer(tmp_path: Path, body: str, **kwargs: float) -> TrainerProcess:
    options = {"start_timeout": 10.0, "heartbeat_interval": 0.1, "idle_timeout": 10.0, **kwargs}
    return TrainerProcess(tmp_path / "model", python=stand_in(tmp_path, body), **options)  # type: ignore[arg-type]


async def collect(process: TrainerProcess, tmp_path: Path) -> list[dict[str, object]]:
    events = []
    async for event in process.train("m", tmp_path / "a", tmp_path / "b", tmp_path / "batch", TrainConfig()):
        events.append(event)
    return events


async def test_a_worker_that_dies_at_start_is_reported_with_its_stderr(tmp_path: Path) -> None:
    process = trainer(tmp_path, 'print("cannot load the model: boom", file=sys.stderr); sys.exit(3)')
    with pytest.raises(TrainerCrashed) as info:
        await process.start()
    assert info.value.returncode == 3
    assert "boom" in info.value.stderr_tail


async def test_a_worker_that_never_gets_ready_times_out_and_is_killed(tmp_path: Path) -> None:
    process = trainer(tmp_path, "time.sleep(60)", start_timeout=0.5)
    with pytest.raises(TrainerTimeout):
        await process.start()
    assert not process.is_running


async def test_heartbeats_while_the_worker_is_quiet_then_a_timeout(tmp_path: Path) -> None:
    body = """
    emit("ready", 0)
    for command in commands():
        emit("train_started", command["id"])
        time.sleep(60)
    """
    process = trainer(tmp_path, body, idle_timeout=0.6)
    await process.start()
    seen: list[str] = []
    with pytest.raises(TrainerTimeout):
        async for event in process.train(
            "m", tmp_path / "a", tmp_path / "b", tmp_path / "batch", TrainConfig()
        ):
            seen.append(str(event["event"]))
    assert seen[0] == "train_started"
    assert seen.count(HEARTBEAT) >= 3
    assert not process.is_running


async def test_errors_are_typed_and_the_worker_keeps_serving(tmp_path: Path) -> None:
    body = """
    emit("ready", 0)
    for command in commands():
        if command["cmd"] == "train":
            emit("error", command["id"], kind="BatchError", message="token id 99999 outside the vocabulary")
        else:
            emit("pong", command["id"])
    """
    process = trainer(tmp_path, body)
    await process.start()
    with pytest.raises(TrainerError) as info:
        await collect(process, tmp_path)
    assert info.value.kind == "BatchError"
    pid = process.pid
    await process.ping()
    assert process.pid == pid
    await process.stop()


async def test_events_of_an_abandoned_command_are_skipped(tmp_path: Path) -> None:
    # The worker answers each command with events of an older id first: the client must not mistake them.
    body = """
    emit("ready", 0)
    for command in commands():
        emit("step", command["id"] - 1, gradient_step=99)
        emit("saved" if command["cmd"] == "train" else "pong", command["id"], path="out")
    """
    process = trainer(tmp_path, body)
    events = await collect(process, tmp_path)
    assert [e["event"] for e in events] == ["saved"]
    await process.stop()


async def test_a_crash_mid_command_is_reported_and_the_next_call_restarts(tmp_path: Path) -> None:
    marker = tmp_path / "started-once"
    body = f"""
    import pathlib
    marker = pathlib.Path({str(marker)!r})
    first = not marker.exists()
    marker.touch()
    emit("ready", 0)
    for command in commands():
        if first:
            print("Segmentation fault", file=sys.stderr, flush=True)
            sys.exit(139)
        emit("pong", command["id"])
    """
    process = trainer(tmp_path, body)
    await process.start()
    first_pid = process.pid
    with pytest.raises(TrainerCrashed) as info:
        await collect(process, tmp_path)
    assert info.value.returncode == 139 and "Segmentation fault" in info.value.stderr_tail
    await process.ping()  # a fresh worker
    assert process.pid != first_pid
    await process.stop()


async def test_the_trainer_log_rotates_at_its_size_limit(tmp_path: Path) -> None:
    body = 'for i in range(3000): print(f"stderr line {i:05d} " + "y" * 80, file=sys.stderr)\nsys.exit(3)'
    log_path = tmp_path / "logs" / "trainer.log"
    process = TrainerProcess(tmp_path / "model", python=stand_in(tmp_path, body), start_timeout=10.0,
                             log_path=log_path, log_max_bytes=64 * 1024, log_backups=2)
    with pytest.raises(TrainerCrashed) as info:
        await process.start()
    assert "stderr line 02999" in str(info.value)
    assert sorted(p.name for p in log_path.parent.iterdir()) == ["trainer.log", "trainer.log.1", "trainer.log.2"]
    assert all(p.stat().st_size <= 64 * 1024 for p in log_path.parent.iterdir())
    assert "stderr line 02999" in log_path.read_text()
