"""Runs the vLLM engine as a child process: start, wait until ready, watch, restart after a crash, stop.

    stopped ──start()──▶ starting ──healthy + warmed up + on_ready──▶ ready
                            │ exits / times out: EngineStartError          │ exits, or health fails
                            ▼                                               ▼ N checks in a row
                          failed ◀──max_failed_restarts in a row── restarting ──▶ ready (restarts += 1)
    any state ──stop()──▶ stopped

The engine runs in its own process group (vLLM's API server spawns an EngineCore process, which on a GPU
spawns a worker), so stopping signals the whole group: SIGTERM, a grace period, then SIGKILL, and waits until
no process of the group is left. `orphan_guard` makes the engine get SIGTERM if this process dies
without stopping it. Its output goes through a pipe into `config.log_path`, rotated by size (`logfiles`: a
child writing the file itself could grow it forever); a start that fails raises `EngineStartError`
carrying the log's tail, because that is where vLLM says why.

Each start gets a fresh random API key (in the engine's environment; the client sends it), and before
anything carrying the key is sent, the supervisor checks that the socket listening on the engine port
belongs to its own child: `free_port` only names a port that was free a moment ago, and another local
process that binds it first could otherwise answer /health and receive the key and every prompt.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import sys
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import httpx
import psutil

from artlike_server.engine.client import EngineClient
from artlike_server.engine.errors import EngineError
from artlike_server.engine.launch import EngineConfig, build_command, build_env
from artlike_server.logfiles import RotatingLog, pump

logger = logging.getLogger(__name__)

OnReady = Callable[[], Awaitable[None]]
_DRAIN_TIMEOUT_S = 5.0  # an exited engine's children may hold the log pipe open a little longer


class EngineState(StrEnum):
    STARTING = "starting"
    READY = "ready"
    RESTARTING = "restarting"
    STOPPED = "stopped"
    FAILED = "failed"


class EngineStartError(EngineError):
    """The engine exited or did not become ready in time; the message ends with the engine log's tail."""

    def __init__(self, reason: str, log_path: Path, log_tail: str) -> None:
        super().__init__(f"{reason}\n--- last lines of {log_path} ---\n{log_tail}")
        self.reason = reason
        self.log_path = log_path
        self.log_tail = log_tail


@dataclass(frozen=True)
class SupervisionPolicy:
    """How the supervisor watches and restarts the engine (defaults suit a loaded 2-core CPU box)."""

    health_interval_s: float = 5.0
    # A busy engine answers /health slowly, a hung one never. On a few shared cores (a full batch plus the
    # trainer) /health can take many seconds: restarting then would kill every request in flight.
    health_timeout_s: float = 30.0
    unhealthy_checks_before_restart: int = 4
    max_failed_restarts: int = 5  # consecutive failed restart attempts before giving up (FAILED)
    restart_backoff_s: float = 2.0  # doubled after each failed attempt
    restart_backoff_max_s: float = 60.0
    warm_up_timeout_s: float = 120.0  # the first logprobs request compiles a helper
    stop_grace_s: float = 20.0  # SIGTERM -> SIGKILL
    kill_wait_s: float = 10.0
    progress_interval_s: float = 10.0
    log_tail_lines: int = 40
    default_startup_s: float = 60.0  # Retry-After estimate before a start has been measured
    failed_retry_after_s: float = 60.0


class EngineSupervisor:
    """Owns the vLLM child process and the shared `EngineClient` that talks to it.

    `on_ready` callbacks run after every successful (re)start, before the state becomes READY (the
    adapter store re-loads its adapters there). `progress` receives human-readable start-up progress
    lines (default: this module's logger). `base_env` defaults to `os.environ` (read at each start);
    `command` replaces `build_command(config)` (a stand-in engine in tests). `api_key` fixes the engine's
    key (for tools that talk to the engine directly, like the benchmarks); None: a random one per start.
    """

    def __init__(
        self,
        config: EngineConfig,
        on_ready: Sequence[OnReady] = (),
        *,
        policy: SupervisionPolicy | None = None,
        client: EngineClient | None = None,
        progress: Callable[[str], None] | None = None,
        base_env: Mapping[str, str] | None = None,
        command: Sequence[str] | None = None,
        api_key: str | None = None,
    ) -> None:
        self.config = config
        self.policy = policy or SupervisionPolicy()
        self._on_ready = list(on_ready)
        self._owns_client = client is None
        self.client = client or EngineClient(config.base_url)
        self._progress = progress or logger.info
        self._base_env = base_env
        self._command = list(command) if command is not None else build_command(config)
        self._api_key = api_key
        self._state = EngineState.STOPPED
        self._stopped = False  # stop() was called: start() is refused from then on
        self._state_changed = asyncio.Condition()
        self._restarts = 0
        self._process: asyncio.subprocess.Process | None = None
        self._exit_task: asyncio.Task[int] | None = None
        self._monitor_task: asyncio.Task[None] | None = None
        self._down_since: float | None = None
        self._last_startup_s: float | None = None
        self.last_error: str | None = None
        self._log: RotatingLog | None = None  # opened at the first start, shared by every restart
        self._log_drained = threading.Event()  # the current engine's output is all in the log

    # -- public state -------------------------------------------------------------------------------

    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def base_url(self) -> str:
        return self.config.base_url

    @property
    def restarts(self) -> int:
        """Times the engine was brought back after a crash or a hang."""
        return self._restarts

    @property
    def pid(self) -> int | None:
        """The vLLM API server's pid (also its process group id), None when no engine runs."""
        return self._process.pid if self._process is not None else None

    @property
    def last_startup_s(self) -> float | None:
        """Seconds the last successful (re)start took, warm-up included."""
        return self._last_startup_s

    async def wait_for_state(self, *states: EngineState, timeout_s: float) -> EngineState:
        """Wait until the state is one of `states` and return it; TimeoutError after `timeout_s`."""
        async with asyncio.timeout(timeout_s), self._state_changed:
            await self._state_changed.wait_for(lambda: self._state in states)
            return self._state

    def add_on_ready(self, callback: OnReady) -> None:
        self._on_ready.append(callback)

    def retry_after(self) -> float:
        """Seconds a client should wait before retrying (for a 503's Retry-After); 0 when ready."""
        if self._state is EngineState.READY:
            return 0.0
        if self._state in (EngineState.FAILED, EngineState.STOPPED):
            return self.policy.failed_retry_after_s
        expected = self._last_startup_s or self.policy.default_startup_s
        elapsed = (
            asyncio.get_running_loop().time() - self._down_since if self._down_since is not None else 0.0
        )
        return max(1.0, expected - elapsed)

    # -- lifecycle ----------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the engine and return once it is ready; raises EngineStartError (state FAILED)."""
        if self._stopped:
            raise RuntimeError("a stopped engine supervisor cannot start again (its client is closed)")
        if self._state not in (EngineState.STOPPED, EngineState.FAILED):
            raise RuntimeError(f"engine supervisor is {self._state}, not stopped")
        await self._set_state(EngineState.STARTING)
        try:
            await self._launch()
            await self._run_on_ready()
        except BaseException:
            await self._terminate()
            await self._set_state(EngineState.FAILED)
            raise
        await self._set_state(EngineState.READY)
        self._monitor_task = asyncio.create_task(self._monitor(), name="artlike-engine-monitor")

    async def stop(self) -> None:
        """Stop watching, terminate the whole engine process group and close the client (if owned).
        Final: after a failed start, call start() again instead."""
        self._stopped = True
        if self._monitor_task is not None:
            self._monitor_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor_task
            self._monitor_task = None
        await self._terminate()
        await self._set_state(EngineState.STOPPED)
        if self._owns_client:
            await self.client.aclose()
        if self._log is not None:
            self._log.close()  # a pump still running drops what the gone engine's last words were

    # -- starting -----------------------------------------------------------------------------------

    async def _launch(self) -> None:
        """Spawn vLLM, wait for /health, warm up. Raises EngineStartError; leaves the process to the caller."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + self.config.startup_timeout_s
        await self._spawn()
        await self._wait_until_healthy(started, deadline)
        self._progress(f"engine healthy after {loop.time() - started:.0f}s; warming up")
        await self._warm_up()
        self._last_startup_s = loop.time() - started
        self._progress(f"engine ready after {self._last_startup_s:.0f}s (pid {self.pid})")

    async def _spawn(self) -> None:
        command = self._command
        api_key = self._api_key or secrets.token_urlsafe(32)
        env = build_env(self.config, os.environ if self._base_env is None else self._base_env, api_key=api_key)
        self.client.set_api_key(api_key)
        if sys.platform == "linux":
            # On CPU with cores given, every engine process runs on them (not only vLLM's compute threads).
            pin = self.config.device == "cpu" and self.config.cpu_ids is not None
            cpus = ["--cpus", ",".join(map(str, self.config.cpu_ids or ()))] if pin else []
            command = [sys.executable, "-m", "artlike_server.orphan_guard", str(os.getpid()), *cpus, "--",
                       *command]
        if self._log is None:
            self._log = RotatingLog(self.config.log_path, max_bytes=self.config.log_max_bytes,
                                    backups=self.config.log_backups)
        self._log.write(f"\n===== artlike: starting vLLM: {' '.join(command)}\n".encode())
        read_fd, write_fd = os.pipe()
        self._log_drained = threading.Event()
        pump(read_fd, self._log, name="artlike-engine-log", on_eof=self._log_drained.set)
        try:
            # Own session and process group: a terminal's Ctrl-C reaches only us (we stop the engine in
            # order), and killpg reaches vLLM's EngineCore (and any worker) processes too.
            self._process = await asyncio.create_subprocess_exec(
                *command, stdin=asyncio.subprocess.DEVNULL, stdout=write_fd, stderr=asyncio.subprocess.STDOUT,
                env=env, start_new_session=True,
            )  # fmt: skip
        finally:
            os.close(write_fd)  # the child holds its own copy; EOF once every engine process is gone
        self._exit_task = asyncio.create_task(
            self._process.wait(), name=f"artlike-engine-exit-{self._process.pid}"
        )
        logger.info("engine process %d started, logging to %s", self._process.pid, self.config.log_path)

    async def _wait_until_healthy(self, started: float, deadline: float) -> None:
        assert self._exit_task is not None
        loop = asyncio.get_running_loop()
        next_progress = started + self.policy.progress_interval_s
        while True:
            if self._exit_task.done():
                # Its last words (the traceback) may still be in the pipe: let the pump write them first.
                await asyncio.to_thread(self._log_drained.wait, _DRAIN_TIMEOUT_S)
                raise self._start_error(f"vLLM exited with code {self._exit_task.result()} while starting")
            now = loop.time()
            if now >= deadline:
                raise self._start_error(f"vLLM was not healthy after {self.config.startup_timeout_s:.0f}s")
            if await self.client.is_healthy(timeout_s=min(5.0, deadline - now)):
                self._check_listener_is_ours()
                return
            now = loop.time()
            if now >= next_progress:
                self._progress(f"engine starting… {now - started:.0f}s")
                next_progress += self.policy.progress_interval_s
            # Wakes at once if the engine exits; otherwise this is the polling interval of /health.
            await asyncio.wait({self._exit_task}, timeout=max(0.0, min(1.0, deadline - now)))

    def _check_listener_is_ours(self) -> None:
        """Raise EngineStartError unless every socket listening on the engine port is our engine's.

        /health answered, but an impostor can answer anything over HTTP; what it cannot do is put its
        socket into our child's file table. (Only a process of the same user could share the port with
        SO_REUSEPORT, and such a process can read our memory anyway.)"""
        assert self._process is not None
        ours = {process.pid for process in _group_members(self._process.pid)}
        listeners = [
            connection for connection in psutil.net_connections(kind="inet")
            if connection.status == psutil.CONN_LISTEN and connection.laddr.port == self.config.port
        ]  # fmt: skip
        strangers = [connection.pid for connection in listeners if connection.pid not in ours]
        if listeners and not strangers:
            return
        owner = ", ".join("another user's process" if pid is None else f"pid {pid}" for pid in strangers)
        raise self._start_error(
            f"port {self.config.port} is answered by a process that is not this engine ({owner or 'unknown'}); "
            "nothing was sent to it"
        )

    async def _warm_up(self) -> None:
        """Completions with logprobs for a batch of 1, then of 2 sequences, so the helper vLLM compiles
        on its first logprobs request is compiled now, not on a user's request: torch.compile builds a
        kernel specialised to batch size 1 first and a dynamic-size one on the next size it sees (a few
        seconds each on CPU). /v1/completions needs no chat template."""
        for n, temperature in ((1, 0.0), (2, 1.0)):
            body = {
                "model": self.config.served_model_name,
                "prompt": "Hello",
                "max_tokens": 2,
                "n": n,
                "temperature": temperature,
                "logprobs": 1,
            }
            try:
                response = await self.client.http.post(
                    "/v1/completions", json=body, timeout=self.policy.warm_up_timeout_s
                )
            except httpx.TransportError as error:
                raise self._start_error(f"warm-up request failed: {error!r}") from error
            if not response.is_success:
                raise self._start_error(
                    f"warm-up request answered {response.status_code}: {response.text[:300]}"
                )

    async def _run_on_ready(self) -> None:
        for callback in self._on_ready:
            await callback()

    async def _set_state(self, state: EngineState) -> None:
        if state in (EngineState.STARTING, EngineState.RESTARTING):
            self._down_since = asyncio.get_running_loop().time()
        elif state is EngineState.READY:
            self._down_since = None
        async with self._state_changed:
            self._state = state
            self._state_changed.notify_all()

    def _start_error(self, reason: str) -> EngineStartError:
        return EngineStartError(
            reason, self.config.log_path, _tail(self.config.log_path, self.policy.log_tail_lines)
        )

    # -- watching and restarting --------------------------------------------------------------------

    async def _monitor(self) -> None:
        try:
            await self._watch()
        except Exception as error:  # a bug here must not leave the state READY with nobody watching
            logger.exception("engine monitor crashed")
            self.last_error = f"engine monitor crashed: {error!r}"
            await self._set_state(EngineState.FAILED)

    async def _watch(self) -> None:
        unhealthy = 0
        while True:
            assert self._exit_task is not None
            done, _ = await asyncio.wait({self._exit_task}, timeout=self.policy.health_interval_s)
            if done:
                reason = f"vLLM exited with code {self._exit_task.result()}"
            elif await self.client.is_healthy(timeout_s=self.policy.health_timeout_s):
                unhealthy = 0
                continue
            else:
                unhealthy += 1
                logger.warning(
                    "engine health check failed (%d/%d)",
                    unhealthy,
                    self.policy.unhealthy_checks_before_restart,
                )
                if unhealthy < self.policy.unhealthy_checks_before_restart:
                    continue
                reason = f"vLLM failed {unhealthy} health checks in a row"
            unhealthy = 0
            if not await self._restart(reason):
                return

    async def _restart(self, reason: str) -> bool:
        """Bring the engine back; False (state FAILED) after max_failed_restarts attempts in a row."""
        logger.error("engine down (%s); restarting — see %s", reason, self.config.log_path)
        self.last_error = reason
        await self._set_state(EngineState.RESTARTING)
        await self._terminate()  # the API server may be gone while its EngineCore lives on
        for attempt in range(self.policy.max_failed_restarts):
            backoff = min(self.policy.restart_backoff_s * 2**attempt, self.policy.restart_backoff_max_s)
            await asyncio.sleep(backoff)  # a pause between attempts, not a wait for some event
            try:
                await self._launch()
            except EngineStartError as error:
                logger.error("engine restart attempt %d failed: %s", attempt + 1, error)
                self.last_error = str(error)
                await self._terminate()
                continue
            self._restarts += 1
            await self._run_on_ready_after_restart()
            await self._set_state(EngineState.READY)
            logger.info("engine restarted (restart #%d)", self._restarts)
            return True
        logger.error("engine failed %d restarts in a row; giving up", self.policy.max_failed_restarts)
        await self._set_state(EngineState.FAILED)
        return False

    async def _run_on_ready_after_restart(self) -> None:
        # The engine itself is up; a failing callback (e.g. an adapter that no longer loads) must not
        # kill the monitor. It is logged with its traceback and kept in `last_error`.
        for callback in self._on_ready:
            try:
                await callback()
            except Exception as error:
                logger.exception("on_ready callback %r failed after an engine restart", callback)
                self.last_error = f"on_ready callback {callback!r} failed: {error!r}"

    # -- stopping -----------------------------------------------------------------------------------

    async def _terminate(self) -> None:
        """SIGTERM the engine's process group, SIGKILL after the grace period, wait until it is empty."""
        process, exit_task = self._process, self._exit_task
        if process is None or exit_task is None:
            return
        pgid = process.pid  # start_new_session: the API server leads its own group
        if not await self._signal_group_and_wait(pgid, signal.SIGTERM, exit_task, self.policy.stop_grace_s):
            logger.warning(
                "engine did not stop within %.0fs of SIGTERM; sending SIGKILL", self.policy.stop_grace_s
            )
            if not await self._signal_group_and_wait(
                pgid, signal.SIGKILL, exit_task, self.policy.kill_wait_s
            ):
                survivors = [p.pid for p in _group_members(pgid)]
                raise EngineError(f"engine processes {survivors} survived SIGKILL (process group {pgid})")
        self._process = None
        self._exit_task = None

    @staticmethod
    async def _signal_group_and_wait(
        pgid: int, signum: int, exit_task: asyncio.Task[int], timeout_s: float
    ) -> bool:
        """Signal every process of group `pgid`; True once the leader is reaped and the group is empty."""
        with contextlib.suppress(ProcessLookupError):  # nobody left in the group: fine
            os.killpg(pgid, signum)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        await asyncio.wait({exit_task}, timeout=timeout_s)
        if not exit_task.done():
            return False
        return await _wait_for_exit(_group_members(pgid), max(0.0, deadline - loop.time()))


def _tail(path: Path, lines: int) -> str:
    """The last `lines` lines of the log (read from the end: logs grow large), continued from the newest
    rotated file when the log was rotated moments ago."""
    wanted = 200 * lines
    chunks: list[bytes] = []
    for candidate in (path, path.with_name(f"{path.name}.1")):
        try:
            with candidate.open("rb") as log:
                log.seek(0, os.SEEK_END)
                log.seek(max(0, log.tell() - wanted))
                chunks.insert(0, log.read())
        except FileNotFoundError:
            continue
        wanted -= len(chunks[0])
        if wanted <= 0:
            break
    if not chunks:
        return "(no engine log was written)"
    return "\n".join(b"".join(chunks).decode(errors="replace").splitlines()[-lines:])


def _group_members(pgid: int) -> list[psutil.Process]:
    """Live processes of process group `pgid`: the API server and the EngineCore/worker it spawned,
    including those orphaned when the API server died first. Zombies count as gone."""
    members = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == pgid and process.status() != psutil.STATUS_ZOMBIE:
                members.append(process)
        except (ProcessLookupError, psutil.NoSuchProcess):  # exited while we looked
            continue
    return members


async def _wait_for_exit(processes: Sequence[psutil.Process], timeout_s: float) -> bool:
    """True once every process has exited (they are not our children: a pidfd tells when each ends)."""
    loop = asyncio.get_running_loop()
    waiters: list[asyncio.Future[None]] = []
    fds: list[int] = []
    try:
        for process in processes:
            try:
                fd = os.pidfd_open(process.pid)
            except ProcessLookupError:
                continue
            fds.append(fd)
            exited: asyncio.Future[None] = loop.create_future()
            loop.add_reader(fd, _set_result_once, exited)
            waiters.append(exited)
        if not waiters:
            return True
        _, pending = await asyncio.wait(waiters, timeout=timeout_s)
        return not pending
    finally:
        for fd in fds:
            loop.remove_reader(fd)
            os.close(fd)


def _set_result_once(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
