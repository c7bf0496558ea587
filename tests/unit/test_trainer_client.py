"""TrainerProcess's process handling (start, crash, silence, stale events) against small stand-in workers.

Each stand-in is a real executable speaking (part of) the worker protocol, passed as the `python` the
client launches; the real worker is exercised in tests/integration/test_trainer_worker.py.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
from artlike_server.trainer_ipc import protocol
from artlike_server.training.trainer_client import (
    TrainerCrashed,
    TrainerError,
    TrainerProcess,
    TrainerTimeout,
)

from artlike.types import GRPOConfig


def stand_in(tmp_path: Path, body: str) -> str:
    """An executable that ignores the worker's command line and runs `body` (with `emit` and `commands`)."""
    script = tmp_path / "worker"
    script.write_text(
        f"#!{sys.executable}\n"
        + textwrap.dedent(
            """
            import json, sys, time
            DEFAULTS = {  # the fields each event must carry (artlike_server.trainer_ipc.protocol)
                "ready": {"device": "cpu", "dtype": "float32", "threads": 1, "backend": "peft", "vocab_size": 10,
                          "load_seconds": 0.0},
                "train_started": {"num_gradient_steps": 1, "sequences": 1, "trainable_tokens": 1,
                                  "optimizer_state": "fresh"},
                "step": {"gradient_step": 1, "num_gradient_steps": 1, "loss": 0.0, "policy_loss": 0.0, "kl": 0.0,
                         "entropy": 0.0, "grad_norm": 0.0, "clip_fraction": 0.0, "learning_rate": 1e-5,
                         "tokens": 1, "seconds": 0.0},
                "saved": {"path": "out", "seconds": 0.0},
            }
            def emit(event, id, **fields):
                print(json.dumps({"event": event, "id": id, **DEFAULTS.get(event, {}), **fields}), flush=True)
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


async def collect(process: TrainerProcess, tmp_path: Path) -> list[protocol.TrainEvent]:
    events = []
    async for event in process.train("m", tmp_path / "a", tmp_path / "b", tmp_path / "batch", GRPOConfig()):
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
            "m", tmp_path / "a", tmp_path / "b", tmp_path / "batch", GRPOConfig()
        ):
            seen.append(event.event)
    assert seen[0] == "train_started"
    assert seen.count("heartbeat") >= 3
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
    assert [e.event for e in events] == ["saved"]
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


BUSY_TRAINING = """
emit("ready", 0)
for command in commands():
    emit("train_started", command["id"])
    time.sleep(120)  # a long job: the worker reads no command until it ends
"""


async def test_an_abandoned_train_kills_the_busy_worker_so_stop_is_prompt(tmp_path: Path) -> None:
    process = trainer(tmp_path, BUSY_TRAINING)
    await process.start()
    started = asyncio.Event()

    async def consume() -> None:
        async for event in process.train("m", tmp_path / "a", tmp_path / "b", tmp_path / "batch", GRPOConfig()):
            if event.event == "train_started":
                started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    worker = psutil.Process(process.pid)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    async with asyncio.timeout(10):  # not command_timeout (120 s): the worker was killed, not asked
        await process.stop()
    assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's")
def test_the_worker_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    # A parent that starts a worker, says its pid, and is then SIGKILLed (no cleanup runs). The worker is
    # busy (it reads no command, so it would not notice its stdin closing).
    busy = stand_in(tmp_path, 'emit("ready", 0); time.sleep(120)')
    script = f"""
import asyncio, sys
from pathlib import Path
from artlike_server.training.trainer_client import TrainerProcess
async def main():
    process = TrainerProcess(Path("model"), python={busy!r}, start_timeout=10.0)
    await process.start()
    print(process.pid, flush=True)
    await asyncio.sleep(120)
asyncio.run(main())
"""
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    try:
        assert parent.stdout is not None
        worker = psutil.Process(int(parent.stdout.readline()))
    finally:
        parent.kill()
        parent.wait()
    try:
        worker.wait(timeout=10)  # the worker is not our child: psutil polls until it is gone
    except psutil.TimeoutExpired:
        worker.kill()
        pytest.fail("the trainer worker outlived its parent")


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
