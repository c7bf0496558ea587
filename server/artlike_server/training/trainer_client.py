"""asyncio client of the trainer worker process (`artlike_server.torch_worker.worker`).

One `TrainerProcess` owns one worker: it spawns it, waits for its `ready` event, sends one command at a time
(an asyncio.Lock) and turns the worker's events into return values, an async iterator, or typed errors.
`score` is the exception: it does not wait for the lock, since the worker answers a score between two
micro-batches of a running job (scores wait their turn among themselves). Events are routed by command id.
Every wait has a limit and nothing waits silently: while a command runs, `train()` yields a heartbeat
whenever the worker has said nothing for `heartbeat_interval` seconds.

    TrainerFailure            any trainer problem
    ├── TrainerCrashed        the process died (start failure included); carries the stderr tail
    ├── TrainerError          a command failed; the worker is alive and takes the next command
    └── TrainerTimeout        the worker said nothing for too long; it was killed

After a crash or a timeout the next call starts a fresh worker (the base model loads again, a few seconds).
A `train()` abandoned mid-command (its task cancelled, e.g. at server shutdown) kills the worker: it would
otherwise train on to the end before reading the next command. On Linux the worker runs under the same
parent-death guard as the engine (`orphan_guard.py`): it gets SIGTERM if this process dies.

With several GPUs (`gpus`) the worker runs under torchrun, one rank per GPU (`torch_worker/distributed.py`):
the process this client talks to is torchrun, whose rank 0 inherits the pipes; the protocol is the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from collections import deque
from collections.abc import AsyncGenerator, Mapping, Sequence
from pathlib import Path
from typing import Literal

from pydantic import ValidationError

from artlike.types import LoraConfig, RewardHeadConfig, TrainConfig
from artlike_server.child_env import without_secrets
from artlike_server.logfiles import RotatingLog
from artlike_server.trainer_ipc import protocol
from artlike_server.training.pass_batching import PassBatcher

logger = logging.getLogger("artlike.trainer_client")

_STDERR_TAIL_LINES = 40
_STREAM_LIMIT = 1 << 20  # bytes per stdout line


class TrainerFailure(RuntimeError):
    """Base of the trainer client's errors."""


class TrainerCrashed(TrainerFailure):
    def __init__(self, message: str, *, returncode: int | None, stderr_tail: str) -> None:
        super().__init__(
            f"{message} (exit code {returncode})\n--- trainer stderr (last lines) ---\n{stderr_tail}"
        )
        self.returncode = returncode
        self.stderr_tail = stderr_tail


class TrainerError(TrainerFailure):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind  # the worker-side exception type name, e.g. "BatchError", "AdapterError"
        self.message = message


class TrainerTimeout(TrainerFailure):
    pass


def launcher_args(gpus: tuple[int, ...] | None, ranks: int, device: str) -> list[str]:
    """What runs the worker module: nothing (plain `python -m`) for one process, torchrun for several."""
    if gpus is not None:
        if not gpus or len(set(gpus)) != len(gpus) or min(gpus) < 0:
            raise ValueError(f"gpus must list distinct device indices, not {gpus}")
        if device == "cpu":
            raise ValueError("gpus were given for a CPU trainer")
        if ranks != 1:
            raise ValueError("give gpus (one rank per GPU) or CPU ranks, not both")
    elif ranks > 1 and device != "cpu":
        raise ValueError("ranks without gpus run on the CPU: pass device='cpu'")
    count = len(gpus) if gpus is not None else ranks
    if count < 1:
        raise ValueError(f"ranks must be at least 1, not {ranks}")
    if count == 1:
        return []
    # --standalone: a rendezvous on a free local port, so several trainers on one host do not collide.
    return ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={count}"]


SessionCommand = (
    protocol.SessionOpen | protocol.Pass | protocol.OptimStep | protocol.SaveState | protocol.SessionClose
)


class TrainerProcess:
    def __init__(
        self,
        base_model: Path,
        *,
        dtype: Literal["auto", "bfloat16", "float32"] = "auto",
        device: Literal["auto", "cpu", "cuda"] = "auto",
        gradient_checkpointing: bool = False,
        threads: int | None = None,
        cpus: tuple[int, ...] | None = None,
        gpus: tuple[int, ...] | None = None,
        own_cores: bool = False,
        attention: Literal["auto", "sdpa", "eager"] = "auto",
        ranks: int = 1,
        log_path: Path | None = None,
        log_max_bytes: int = 64 * 1024 * 1024,
        log_backups: int = 3,
        python: str = sys.executable,
        env: Mapping[str, str] | None = None,
        start_timeout: float = 300.0,
        command_timeout: float = 120.0,
        heartbeat_interval: float = 10.0,
        idle_timeout: float = 900.0,
        fuse_passes: bool = True,
    ) -> None:
        """`cpus`: the cores the worker runs on (its affinity; threads default to their count; several ranks
        split them). `gpus`: the CUDA devices it trains on (CUDA_VISIBLE_DEVICES); with more than one, one
        rank per device under torchrun. `own_cores`: nothing else computes on the worker's cores (no engine:
        `placement.trainer_owns_its_cores`), so its threads may spin-wait. `attention`: the worker's attention
        implementation (auto: `torch_worker/attention.py` on a CPU, SDPA elsewhere). `ranks`: that many CPU ranks (gloo)
        under torchrun instead, with
        `device="cpu"`: the multi-rank path without GPUs, for tests.
        Limits, in seconds: `start_timeout` for loading the base model; `command_timeout` for ping,
        init_adapter and shutdown; `idle_timeout` for the worker's silence during training (it reports every
        micro-batch) before it is declared hung and killed. `fuse_passes`: several models' waiting session passes
        go to the worker as one command (`pass_batching.py`); off, each pass runs alone."""
        self._argv = [
            python, *launcher_args(gpus, ranks, device), "-m", "artlike_server.torch_worker.worker",
            "--base-model", str(base_model), "--dtype", dtype, "--device", device,
            *(["--gradient-checkpointing"] if gradient_checkpointing else []),
            *(["--attention", attention] if attention != "auto" else []),
            *(["--threads", str(threads)] if threads else []),
            *(["--cpus", ",".join(map(str, cpus))] if cpus else []),
        ]  # fmt: skip
        self._env = without_secrets(os.environ if env is None else env)
        if gpus:
            self._env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
        # libgomp's default spin-waiting makes torch many times slower when the cores are shared (vLLM, other
        # jobs): a parallel region waits for a descheduled thread, so there threads sleep at once. On cores
        # of its own a step's many small parallel regions pay for that sleep, so they spin briefly first:
        # 10^4 spins (~tens of microseconds, then sleep: an idle worker burns nothing;
        # bench/train_throughput.py measures the step).
        if own_cores and "OMP_WAIT_POLICY" not in self._env:
            self._env.setdefault("GOMP_SPINCOUNT", "10000")
        else:
            self._env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        self._log_path = log_path
        self._log_max_bytes = log_max_bytes  # log_path rotates at this size (artlike_server.logfiles)
        self._log_backups = log_backups
        self._log: RotatingLog | None = None
        self._start_timeout = start_timeout
        self._command_timeout = command_timeout
        self._heartbeat_interval = heartbeat_interval
        self._idle_timeout = idle_timeout
        self._lock = asyncio.Lock()
        self._score_lock = asyncio.Lock()
        self.passes = PassBatcher(self._lock, self._run_passes, max_passes=8 if fuse_passes else 1)
        self._proc: asyncio.subprocess.Process | None = None
        self._waiters: dict[int, asyncio.Queue[protocol.WorkerEvent | None]] = {}  # command id -> its events
        self._eof = False
        self._readers: list[asyncio.Task[None]] = []
        self._stderr_tail: deque[str] = deque(maxlen=_STDERR_TAIL_LINES)
        self._next_id = 1
        self.ready_info: protocol.Ready | None = None
        """The worker's `ready` event: device, dtype, threads, backend, load_seconds..."""

    # ------------------------------------------------------------------------------------ public

    @property
    def is_running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    async def start(self) -> protocol.Ready:
        """Spawn the worker (if not running) and wait for it to load the base model; returns `ready`."""
        async with self._lock:
            return await self._ensure_started()

    async def ping(self) -> None:
        async with self._lock:
            await self._ensure_started()
            await self._complete(protocol.Ping(id=self._take_id()))

    async def init_adapter(
        self, model_name: str, lora: LoraConfig, out_dir: Path, *, seed: int = 0,
        reward_head: RewardHeadConfig | None = None,
    ) -> protocol.AdapterReady:
        """Write a fresh adapter (outputs identical to the base model) to `out_dir`, with a fresh score head
        for a reward model; returns `adapter_ready`."""
        async with self._lock:
            await self._ensure_started()
            command = protocol.InitAdapter(
                id=self._take_id(), model_name=model_name, lora=lora, out_dir=str(out_dir), seed=seed,
                reward_head=reward_head,
            )
            ready = await self._complete(command)
            assert isinstance(ready, protocol.AdapterReady), ready
            return ready

    async def session_command(self, command: SessionCommand) -> protocol.WorkerEvent:
        """Run one training-session command (`torch_worker/training_sessions.py`) and return its answer; `command.id` is
        assigned here. Returns with the worker's pid unchanged, or raises: a new worker has no session. A pass
        may run together with other models' (`pass_batching.py`)."""
        if isinstance(command, protocol.Pass):
            return await self.passes.submit(command)
        async with self._lock:
            await self._ensure_started()
            command.id = self._take_id()
            try:
                await self._send(command)
                return await self._wait_for(command.id, self._idle_timeout)
            except (asyncio.CancelledError, GeneratorExit):
                self._abandon()
                raise

    async def _run_passes(self, commands: Sequence[protocol.Pass]) -> list[protocol.PassDone | BaseException]:
        """Passes as one worker command (the lock is held): one `pass`, or one `passes` for several."""
        await self._ensure_started()
        for command in commands:
            command.id = self._take_id()
        sent: protocol.Pass | protocol.Passes = (
            commands[0] if len(commands) == 1 else protocol.Passes(id=self._take_id(), passes=list(commands)))
        try:
            await self._send(sent)
            # The worker is silent until the command ends: n passes as one may take n passes' time.
            answer = await self._wait_for(sent.id, self._idle_timeout * len(commands))
        except TrainerError as error:  # the worker refused the command itself
            return [error] * len(commands)
        except (asyncio.CancelledError, GeneratorExit):
            self._abandon()
            raise
        events = answer.results if isinstance(answer, protocol.PassesDone) else [answer]
        results: list[protocol.PassDone | BaseException] = []
        for event in events:
            if isinstance(event, protocol.PassDone):
                results.append(event)
            elif isinstance(event, protocol.Failed):
                results.append(TrainerError(event.kind, event.message))
            else:
                results.append(TrainerError("ProtocolError", f"unexpected answer to a pass: {event!r}"))
        return results

    async def train(
        self, model_name: str, adapter_dir: Path, out_dir: Path, batch_path: Path, config: TrainConfig,
        reference_adapter_dir: Path | None = None, reward_model_dir: Path | None = None,
    ) -> AsyncGenerator[protocol.TrainEvent, None]:
        """Train from `adapter_dir` on the batch file; yields the worker's events, ending with `saved`.
        `reference_adapter_dir`: the step the config's `reference` names (else the base model is the reference).

        Events: `train_started`, `progress` (per micro-batch), `step` (StepEvent fields, per optimizer step),
        `heartbeat` (from this client, when the worker is quiet) and finally `saved` (`path`). Use it
        with `contextlib.aclosing` when the loop may stop early.
        """
        async with self._lock:
            await self._ensure_started()
            command = protocol.Train(
                id=self._take_id(),
                model_name=model_name,
                adapter_dir=str(adapter_dir),
                out_dir=str(out_dir),
                batch_path=str(batch_path),
                config=config,
                reference_adapter_dir=None if reference_adapter_dir is None else str(reference_adapter_dir),
                reward_model_dir=None if reward_model_dir is None else str(reward_model_dir),
            )
            try:
                await self._send(command)
                async for event in self._events_of(command.id, heartbeats=True):
                    if not isinstance(event, protocol.TrainEvent):
                        raise TrainerError("ProtocolError", f"unexpected event during train: {event!r}")
                    yield event
            except (asyncio.CancelledError, GeneratorExit):
                self._abandon()
                raise

    async def score(self, adapter_dir: Path, token_ids: list[list[int]], *,
                    micro_batch_tokens: int = 8192) -> protocol.Scores:
        """Score token sequences with the reward model step at `adapter_dir`, now or (while a job trains)
        between two of its micro-batches. A caller that stops waiting leaves the worker alone."""
        async with self._score_lock:
            if not (self.is_running and self.ready_info is not None):
                async with self._lock:
                    await self._ensure_started()
            command = protocol.Score(id=self._take_id(), adapter_dir=str(adapter_dir), token_ids=token_ids,
                                     micro_batch_tokens=micro_batch_tokens)
            await self._send(command)
            try:
                async with asyncio.timeout(self._idle_timeout):
                    async with contextlib.aclosing(self._events_of(command.id, heartbeats=False,
                                                                   watchdog=False)) as events:
                        async for event in events:
                            if isinstance(event, protocol.Scores):
                                return event
            except TimeoutError:
                raise TrainerTimeout(f"the trainer did not score within {self._idle_timeout:.0f} s") from None
            raise TrainerError("ProtocolError", f"no scores for command {command.id}")

    async def stop(self) -> None:
        """Ask the worker to exit; kill it if it does not within `command_timeout`."""
        async with self._lock:
            if self.is_running and self.ready_info is not None:  # else: starting or abandoned, killed below
                try:
                    await self._complete(protocol.Shutdown(id=self._take_id()))
                except TrainerFailure as exc:
                    logger.warning("trainer did not shut down cleanly: %s", exc)
                if self._proc is not None and self._proc.stdin is not None:
                    self._proc.stdin.close()  # EOF ends the worker's command loop in any case
                await self._reap(self._command_timeout)
            await self._cleanup()

    # ---------------------------------------------------------------------------------- internals

    def _take_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    async def _ensure_started(self) -> protocol.Ready:
        if self.is_running and self.ready_info is not None:
            return self.ready_info
        await self._cleanup()
        self._waiters = {0: asyncio.Queue()}  # `ready`
        self._eof = False
        self._stderr_tail.clear()
        argv = self._argv
        if sys.platform == "linux":
            argv = [sys.executable, "-m", "artlike_server.orphan_guard", str(os.getpid()), "--", *argv]
        self._proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=self._env,
            limit=_STREAM_LIMIT,
        )
        assert self._proc.stdout is not None and self._proc.stderr is not None
        self._readers = [
            asyncio.create_task(self._read_events(self._proc.stdout)),
            asyncio.create_task(self._read_stderr(self._proc.stderr)),
        ]
        logger.info("trainer worker started (pid %d)", self._proc.pid)
        ready = await self._wait_for(0, self._start_timeout)
        if not isinstance(ready, protocol.Ready):
            await self._kill()
            raise TrainerError("ProtocolError", f"the worker's first event was not `ready`: {ready!r}")
        self.ready_info = ready
        return ready

    async def _send(self, command: protocol.Command) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        queue: asyncio.Queue[protocol.WorkerEvent | None] = asyncio.Queue()
        self._waiters[command.id] = queue  # before the write: its events may come at once
        if self._eof:
            queue.put_nowait(None)
        try:
            self._proc.stdin.write(command.model_dump_json().encode() + b"\n")
            await self._proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise await self._crashed(f"trainer worker is gone ({exc})") from exc

    async def _complete(
        self, command: protocol.Ping | protocol.Shutdown | protocol.InitAdapter
    ) -> protocol.WorkerEvent:
        """Send a command and wait (at most `command_timeout` s in all) for its terminal event."""
        await self._send(command)
        return await self._wait_for(command.id, self._command_timeout)

    async def _wait_for(self, command_id: int, limit_seconds: float) -> protocol.WorkerEvent:
        """The terminal event of a command (or `ready` for id 0), within `limit_seconds`."""
        try:
            async with asyncio.timeout(limit_seconds):
                async with contextlib.aclosing(self._events_of(command_id, heartbeats=False)) as events:
                    async for event in events:
                        if isinstance(event, (protocol.Ready, *protocol.TERMINAL_EVENTS)):
                            return event
        except TimeoutError:
            await self._kill()
            raise TrainerTimeout(
                f"trainer worker did not answer within {limit_seconds:.0f} s; killed"
            ) from None
        raise AssertionError("unreachable: the event stream ends only with a terminal event or an error")

    async def _events_of(
        self, command_id: int, *, heartbeats: bool, watchdog: bool = True
    ) -> AsyncGenerator[protocol.WorkerEvent | protocol.Heartbeat, None]:
        """Events of one command until its terminal event; raises on error, crash or (with `watchdog`) a
        worker silent for longer than `idle_timeout`, which is then killed."""
        queue = self._waiters.setdefault(command_id, asyncio.Queue())
        try:
            async for event in self._command_events(command_id, queue, heartbeats=heartbeats, watchdog=watchdog):
                yield event
        finally:
            if self._waiters.get(command_id) is queue:
                del self._waiters[command_id]

    async def _command_events(
        self, command_id: int, queue: asyncio.Queue[protocol.WorkerEvent | None], *, heartbeats: bool,
        watchdog: bool,
    ) -> AsyncGenerator[protocol.WorkerEvent | protocol.Heartbeat, None]:
        started = last_event_at = time.monotonic()
        last_progress: protocol.Progress | None = None
        while True:
            try:
                event = await asyncio.wait_for(queue.get(), timeout=self._heartbeat_interval)
            except TimeoutError:
                now = time.monotonic()
                if watchdog and now - last_event_at > self._idle_timeout:
                    await self._kill()
                    raise TrainerTimeout(
                        f"trainer worker silent for {now - last_event_at:.0f} s (limit {self._idle_timeout:.0f} s); killed"
                    ) from None
                if heartbeats:
                    yield protocol.Heartbeat(
                        id=command_id,
                        elapsed_seconds=now - started,
                        idle_seconds=now - last_event_at,
                        gradient_step=last_progress.gradient_step if last_progress else None,
                        micro_batch=last_progress.micro_batch if last_progress else None,
                        micro_batches=last_progress.micro_batches if last_progress else None,
                    )
                continue
            if event is None:
                raise await self._crashed("trainer worker exited")
            last_event_at = time.monotonic()
            if isinstance(event, protocol.Failed):
                raise TrainerError(event.kind, event.message)
            if isinstance(event, protocol.Progress):
                last_progress = event
            yield event
            if isinstance(event, protocol.TERMINAL_EVENTS):
                return

    async def _read_events(self, stream: asyncio.StreamReader) -> None:
        """Route each event to the queue of the command it answers (events of abandoned commands are dropped)."""
        while line := await stream.readline():
            try:
                event = protocol.WORKER_EVENT.validate_json(line)
            except ValidationError:
                logger.error("trainer wrote a non-protocol line to stdout: %r", line[:200])
                continue
            queue = self._waiters.get(event.id)
            if queue is None:
                logger.debug("skipping an event of a command no longer waited for: %s", event)
                continue
            queue.put_nowait(event)
        self._eof = True  # the process is ending: every waiter hears it
        for queue in self._waiters.values():
            queue.put_nowait(None)

    async def _read_stderr(self, stream: asyncio.StreamReader) -> None:
        if self._log is None and self._log_path is not None:  # one log for every worker this client starts
            self._log = await asyncio.to_thread(
                RotatingLog, self._log_path, max_bytes=self._log_max_bytes, backups=self._log_backups)
        while line := await stream.readline():
            self._stderr_tail.append(line.decode(errors="replace").rstrip("\n"))
            if self._log is not None:
                self._log.write(line)  # one short line: a buffered write, no fsync

    async def _crashed(self, message: str) -> TrainerCrashed:
        returncode = await self._reap(10.0)
        # Let the stderr reader drain the last lines (the traceback) before quoting them.
        if len(self._readers) > 1:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._readers[1]), timeout=5.0)
        self.ready_info = None
        return TrainerCrashed(message, returncode=returncode, stderr_tail="\n".join(self._stderr_tail))

    async def _reap(self, limit_seconds: float) -> int | None:
        if self._proc is None:
            return None
        try:
            return await asyncio.wait_for(self._proc.wait(), timeout=limit_seconds)
        except TimeoutError:
            await self._kill()
            return self._proc.returncode

    def _abandon(self) -> None:
        """Kill the worker without waiting (a command was abandoned); the next call reaps it and starts anew."""
        self.ready_info = None
        if self._proc is not None and self._proc.returncode is None:
            self._proc.kill()

    async def _kill(self) -> None:
        self.ready_info = None
        if self._proc is not None and self._proc.returncode is None:
            self._proc.kill()
            await self._proc.wait()

    async def _cleanup(self) -> None:
        await self._kill()
        for task in self._readers:
            task.cancel()
        for task in self._readers:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._readers = []
        self._proc = None
        self.ready_info = None
