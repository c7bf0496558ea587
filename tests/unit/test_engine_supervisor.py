"""The supervisor's process handling, against a stand-in engine (tests/unit/fake_engine.py) that starts
in a fraction of a second. The real engine is covered by tests/integration/test_engine.py."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
from collections.abc import AsyncIterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil
import pytest
import pytest_asyncio
from artlike_server.engine.launch import EngineConfig, free_port
from artlike_server.engine.supervisor import (
    EngineStartError,
    EngineState,
    EngineSupervisor,
    SupervisionPolicy,
)

FAKE_ENGINE = Path(__file__).with_name("fake_engine.py")
FAST = SupervisionPolicy(
    health_interval_s=0.2,
    health_timeout_s=1.0,
    unhealthy_checks_before_restart=2,
    max_failed_restarts=2,
    restart_backoff_s=0.05,
    stop_grace_s=1.0,
    kill_wait_s=5.0,
)


class Fake:
    """Controls the stand-in engine through files in `control`."""

    def __init__(self, control: Path) -> None:
        self.control = control
        control.mkdir(parents=True, exist_ok=True)
        (control / "pids").touch()

    def mode(self, mode: str) -> None:
        (self.control / "mode").write_text(mode)

    def unhealthy(self, unhealthy: bool) -> None:
        flag = self.control / "unhealthy"
        if unhealthy:
            flag.touch()
        else:
            flag.unlink()

    def processes_still_running(self) -> list[int]:
        alive = []
        for pid in map(int, (self.control / "pids").read_text().split()):
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                continue
        return alive


def supervisor_for(
    tmp_path: Path, fake: Fake, startup_timeout_s: float = 20.0, port: int | None = None,
    command: list[str] | None = None, **kwargs: object
) -> EngineSupervisor:
    port = port or free_port()
    config = EngineConfig(
        model_path=tmp_path / "model",
        served_model_name="fake",
        port=port,
        log_path=tmp_path / "logs" / "engine.log",
        startup_timeout_s=startup_timeout_s,
    )
    command = command or [sys.executable, str(FAKE_ENGINE), str(port), str(fake.control)]
    return EngineSupervisor(config, policy=FAST, command=command, **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def fake(tmp_path: Path) -> Fake:
    fake = Fake(tmp_path / "control")
    fake.mode("ok")
    return fake


@pytest_asyncio.fixture
async def supervisor(tmp_path: Path, fake: Fake) -> AsyncIterator[EngineSupervisor]:
    supervisor = supervisor_for(tmp_path, fake)
    yield supervisor
    await supervisor.stop()
    assert fake.processes_still_running() == []


async def test_start_runs_on_ready_then_reports_ready(tmp_path: Path, fake: Fake) -> None:
    events: list[str] = []

    async def on_ready() -> None:
        events.append(f"on_ready while {supervisor.state}")

    supervisor = supervisor_for(tmp_path, fake, on_ready=[on_ready], progress=events.append)
    assert supervisor.state is EngineState.STOPPED
    await supervisor.start()
    try:
        assert supervisor.state is EngineState.READY
        assert "on_ready while starting" in events
        assert any(event.startswith("engine ready after") for event in events)
        assert supervisor.pid is not None and supervisor.last_startup_s is not None
        assert supervisor.retry_after() == 0.0
        with pytest.raises(RuntimeError):
            await supervisor.start()
    finally:
        await supervisor.stop()
    assert supervisor.state is EngineState.STOPPED and supervisor.pid is None
    assert "===== artlike: starting vLLM" in supervisor.config.log_path.read_text()
    with pytest.raises(RuntimeError, match="cannot start again"):
        await supervisor.start()


async def test_an_engine_that_exits_at_start_raises_with_the_log_tail(
    supervisor: EngineSupervisor, fake: Fake
) -> None:
    fake.mode("exit")
    with pytest.raises(EngineStartError) as caught:
        await supervisor.start()
    assert caught.value.reason == "vLLM exited with code 3 while starting"
    assert "fake engine: cannot load the model" in caught.value.log_tail
    assert str(caught.value).endswith(caught.value.log_tail)
    assert supervisor.state is EngineState.FAILED
    fake.mode("ok")  # a failed start can be retried
    await supervisor.start()
    assert supervisor.state is EngineState.READY


class Impostor:
    """Another local process's HTTP server that took the engine's port first: 200 to everything."""

    def __init__(self, port: int) -> None:
        self.authorizations: list[str | None] = []
        seen = self.authorizations

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self._answer()

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", 0)))
                self._answer()

            def _answer(self) -> None:
                seen.append(self.headers.get("authorization"))
                body = b'{"choices": []}'
                self.send_response(200)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


async def test_a_process_posing_as_the_engine_on_its_port_gets_no_key_and_fails_the_start(
    tmp_path: Path, fake: Fake
) -> None:
    impostor = Impostor(port := free_port())  # won the free_port race
    # The real engine cannot bind the taken port; a stand-in that only waits plays it.
    waits = [sys.executable, "-c", "import time; time.sleep(60)"]
    supervisor = supervisor_for(tmp_path, fake, port=port, command=waits)
    try:
        with pytest.raises(EngineStartError, match="not this engine"):
            await supervisor.start()
    finally:
        impostor.close()
        await supervisor.stop()
    assert all(auth is None for auth in impostor.authorizations), "the engine key went to the impostor"


async def test_each_engine_start_gets_a_fresh_key_the_clients_send(supervisor: EngineSupervisor) -> None:
    await supervisor.start()  # the fake answers the warm-up POSTs only with the key from its environment
    first = supervisor.client.http.headers["Authorization"]
    assert supervisor.pid is not None
    os.kill(supervisor.pid, signal.SIGKILL)
    await supervisor.wait_for_state(EngineState.RESTARTING, timeout_s=10)
    assert await supervisor.wait_for_state(EngineState.READY, timeout_s=20) is EngineState.READY
    assert supervisor.client.http.headers["Authorization"] != first
    assert first.startswith("Bearer ") and len(first) > 40


async def test_an_engine_that_never_gets_healthy_times_out(tmp_path: Path, fake: Fake) -> None:
    fake.unhealthy(True)
    supervisor = supervisor_for(tmp_path, fake, startup_timeout_s=1.5)
    with pytest.raises(EngineStartError, match="not healthy after 2s"):
        await supervisor.start()
    assert supervisor.state is EngineState.FAILED
    assert fake.processes_still_running() == [], "a timed-out start must not leave the engine running"
    await supervisor.stop()


async def test_a_killed_engine_is_restarted(supervisor: EngineSupervisor) -> None:
    ready_calls: list[int | None] = []

    async def on_ready() -> None:
        ready_calls.append(supervisor.pid)

    supervisor.add_on_ready(on_ready)
    await supervisor.start()
    first_pid = supervisor.pid
    assert first_pid is not None
    os.kill(first_pid, signal.SIGKILL)
    assert await supervisor.wait_for_state(EngineState.RESTARTING, timeout_s=10) is EngineState.RESTARTING
    assert supervisor.retry_after() >= 1.0
    assert await supervisor.wait_for_state(EngineState.READY, timeout_s=20) is EngineState.READY
    assert supervisor.restarts == 1
    assert ready_calls == [first_pid, supervisor.pid] and supervisor.pid != first_pid
    assert supervisor.last_error == "vLLM exited with code -9"


async def test_an_engine_that_stops_answering_health_checks_is_restarted(
    supervisor: EngineSupervisor, fake: Fake
) -> None:
    await supervisor.start()
    first_pid = supervisor.pid
    fake.unhealthy(True)
    await supervisor.wait_for_state(EngineState.RESTARTING, timeout_s=10)
    fake.unhealthy(False)
    assert await supervisor.wait_for_state(EngineState.READY, timeout_s=20) is EngineState.READY
    assert supervisor.restarts == 1 and supervisor.pid != first_pid
    assert supervisor.last_error == "vLLM failed 2 health checks in a row"


async def test_restarts_give_up_after_max_failed_attempts(supervisor: EngineSupervisor, fake: Fake) -> None:
    await supervisor.start()
    fake.mode("exit")
    assert supervisor.pid is not None
    os.kill(supervisor.pid, signal.SIGKILL)
    assert await supervisor.wait_for_state(EngineState.FAILED, timeout_s=20) is EngineState.FAILED
    assert supervisor.restarts == 0
    assert supervisor.last_error is not None and "exited with code 3" in supervisor.last_error
    assert supervisor.retry_after() == FAST.failed_retry_after_s


async def test_a_failing_on_ready_callback_after_a_restart_is_recorded_not_fatal(
    supervisor: EngineSupervisor,
) -> None:
    calls = 0

    async def fails_after_restart() -> None:
        nonlocal calls
        calls += 1
        if calls > 1:
            raise ValueError("adapter directory vanished")

    supervisor.add_on_ready(fails_after_restart)
    await supervisor.start()
    assert supervisor.pid is not None
    os.kill(supervisor.pid, signal.SIGKILL)
    await supervisor.wait_for_state(EngineState.RESTARTING, timeout_s=10)
    assert await supervisor.wait_for_state(EngineState.READY, timeout_s=20) is EngineState.READY
    assert supervisor.last_error is not None and "adapter directory vanished" in supervisor.last_error


async def test_stop_kills_a_group_that_ignores_sigterm(supervisor: EngineSupervisor, fake: Fake) -> None:
    fake.mode("stubborn")
    await supervisor.start()
    await supervisor.stop()  # SIGTERM is ignored by the server and its child: SIGKILL after the grace period
    assert fake.processes_still_running() == []
    assert supervisor.state is EngineState.STOPPED


async def test_the_engine_dies_with_the_process_that_started_it(tmp_path: Path, fake: Fake) -> None:
    # A parent that starts a supervised engine and is then SIGKILLed: the orphan guard takes the engine down.
    script = f"""
import asyncio, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from pathlib import Path
from test_engine_supervisor import Fake, supervisor_for
async def main():
    supervisor = supervisor_for(Path({str(tmp_path)!r}), Fake(Path({str(fake.control)!r})))
    await supervisor.start()
    print(supervisor.pid, flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""
    parent = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, stdout=asyncio.subprocess.PIPE
    )
    assert parent.stdout is not None
    engine_pid = int(await asyncio.wait_for(parent.stdout.readline(), timeout=30))
    engine = psutil.Process(engine_pid)
    parent.kill()
    await parent.wait()
    gone, alive = await asyncio.to_thread(psutil.wait_procs, [engine], timeout=10)
    assert engine in gone and not alive
    assert fake.processes_still_running() == []


async def test_the_engine_log_rotates_at_its_size_limit(tmp_path: Path, fake: Fake) -> None:
    fake.mode("chatty")  # 4 MB of output before it serves
    port = free_port()
    config = EngineConfig(model_path=tmp_path / "model", served_model_name="fake", port=port,
                          log_path=tmp_path / "logs" / "engine.log", startup_timeout_s=20.0,
                          log_max_bytes=512 * 1024, log_backups=2)
    supervisor = EngineSupervisor(config, policy=FAST,
                                  command=[sys.executable, str(FAKE_ENGINE), str(port), str(fake.control)])
    await supervisor.start()
    await supervisor.stop()

    logs = sorted(path.name for path in config.log_path.parent.iterdir())
    assert logs == ["engine.log", "engine.log.1", "engine.log.2"]
    sizes = [(config.log_path.parent / name).stat().st_size for name in logs]
    assert all(size <= 512 * 1024 + 64 * 1024 for size in sizes), sizes  # a chunk may overshoot
    # the newest lines are in engine.log, the older ones in .1, .2, oldest dropped
    assert "log line 039999" in config.log_path.read_text()
    assert "log line 000000" not in "".join((config.log_path.parent / name).read_text() for name in logs)
