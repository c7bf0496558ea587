"""User code (reward functions, python graders, tools, next_turn) runs here: never in the server process.

A pool of worker processes (`sandbox_worker.py`), each started, where the kernel lets us (root and util-linux
`unshare`), in new network, mount and pid namespaces: no network at all (even 127.0.0.1 is unreachable), the
data dir hidden under an empty tmpfs, a private size-bounded tmpfs on /tmp as the only writable place, /proc
showing only its own processes, and an unprivileged uid of its own. Everywhere: rlimits on address space,
CPU time (re-armed per call), processes (per uid), file size and open files. The per-call wall-clock timeout
is the parent's: the worker's whole process group is killed (with a pid namespace, everything it forked
dies with it) and a fresh worker takes its place. `enforcement()` says which of these hold here.

`check_program` compiles user code in the server to report syntax errors at request time; it never runs it.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import itertools
import json
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

log = logging.getLogger(__name__)

FailureKind = Literal["raised", "timeout", "killed", "unserializable", "load_failed"]
MAX_REPLY_BYTES = 16 << 20
START_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class SandboxLimits:
    call_timeout_s: float = 10.0  # wall clock per call, enforced by the parent
    memory_bytes: int = 1 << 30  # RLIMIT_AS of a worker
    cpu_seconds_per_call: int = 30  # RLIMIT_CPU, re-armed before each call
    cpu_seconds_lifetime: int = 3600  # a worker is replaced once it has used half of this
    max_processes: int = 16  # RLIMIT_NPROC of the worker's own uid (threads count)
    max_file_bytes: int = 16 << 20  # RLIMIT_FSIZE
    temp_bytes: int = 64 << 20  # the private /tmp (a tmpfs) holds at most this much
    workers: int = 2


class CodeError(Exception):
    """User code that does not compile, or lacks a function it must define."""

    def __init__(self, message: str, *, line: int | None = None) -> None:
        super().__init__(f"line {line}: {message}" if line is not None else message)
        self.message = message
        self.line = line


def check_program(source: str, *, require_one_of: Sequence[str] = ()) -> frozenset[str]:
    """Compile (never run) the source; the names of its top-level functions. Raises CodeError with the line."""
    try:
        tree = ast.parse(source, filename="<reward>")
        compile(tree, "<reward>", "exec")
    except SyntaxError as error:
        raise CodeError(error.msg, line=error.lineno) from error
    functions = frozenset(node.name for node in tree.body if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef))
    if require_one_of and not functions & set(require_one_of):
        wanted = " or ".join(f"{name}()" for name in require_one_of)
        raise CodeError(f"the code must define {wanted}; it defines "
                        f"{', '.join(sorted(functions)) or 'no function'}")
    return functions


@dataclass(frozen=True)
class CallFailure:
    kind: FailureKind
    message: str
    traceback: str | None = None


@dataclass(frozen=True)
class CallResult:
    value: Any = None
    failure: CallFailure | None = None
    seconds: float = 0.0


def _unshare_available() -> bool:
    return os.geteuid() == 0 and shutil.which("unshare") is not None


class _Worker:
    def __init__(self, process: asyncio.subprocess.Process, tmp: Path) -> None:
        self.process = process
        self.tmp = tmp
        self.cpu_used = 0.0

    @property
    def alive(self) -> bool:
        return self.process.returncode is None

    async def kill(self) -> None:
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        await self.process.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)


class Sandbox:
    def __init__(self, work_root: Path, *, hidden_paths: Sequence[Path] = (), limits: SandboxLimits = SandboxLimits()
                 ) -> None:
        self.work_root = work_root
        self.hidden_paths = [str(Path(p).resolve()) for p in hidden_paths]
        self.limits = limits
        self._isolate = _unshare_available()
        self._uid_base = 200_000 + (os.getpid() % 100_000) * 16 if os.geteuid() == 0 else None
        self._slots = asyncio.Semaphore(limits.workers)
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()
        self._serial = itertools.count()
        self._spawned = itertools.count()
        self._closed = False

    def enforcement(self) -> dict[str, str]:
        isolated = "enforced (network namespace)" if self._isolate else "NOT enforced (needs root and unshare)"
        return {
            "network": isolated,
            "data_dir": "hidden (mount namespace)" if self._isolate else "NOT hidden (needs root and unshare)",
            "writable": f"a private {self.limits.temp_bytes >> 20} MiB /tmp only" if self._isolate else "private temp dir as cwd; other paths per "
                                                                       "file permissions",
            "uid": "unprivileged uid per worker" if self._uid_base is not None else "the server's uid",
            "processes": f"{self.limits.max_processes} per worker" if self._uid_base is not None
            else "NOT limited (RLIMIT_NPROC needs a uid of its own)",
            "memory": f"{self.limits.memory_bytes >> 20} MiB address space",
            "cpu": f"{self.limits.cpu_seconds_per_call} s per call",
            "wall_clock": f"{self.limits.call_timeout_s:g} s per call",
        }

    @property
    def worker_uids(self) -> range:
        """The uids this sandbox's workers run as (empty when they keep the server's)."""
        return range(0) if self._uid_base is None else range(self._uid_base, self._uid_base + 16)

    async def start(self) -> None:
        self.work_root.mkdir(parents=True, exist_ok=True)

    async def close(self) -> None:
        self._closed = True
        for worker in list(self._all):
            await worker.kill()
        self._all.clear()
        self._idle.clear()
        shutil.rmtree(self.work_root, ignore_errors=True)

    async def call(self, source: str, function: str, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
                   *, timeout_s: float | None = None) -> CallResult:
        """Run `function(*args, **kwargs)` of `source` in a worker. Failures of the user's code come back as
        `CallResult.failure`; arguments that are not JSON raise TypeError (a bug of the caller)."""
        if self._closed:
            raise RuntimeError("the sandbox is closed")
        limit = timeout_s or self.limits.call_timeout_s
        request = {"id": next(self._serial), "source": source, "function": function, "args": list(args),
                   "kwargs": dict(kwargs or {}), "cpu_seconds": self.limits.cpu_seconds_per_call}
        line = json.dumps(request, allow_nan=True).encode() + b"\n"  # TypeError here: the caller's bug
        async with self._slots:
            started = time.monotonic()
            worker = self._idle.pop() if self._idle else await self._spawn()
            keep = False
            try:
                reply = await asyncio.wait_for(self._exchange(worker, line), limit)
                # A worker whose code left processes behind, or used much CPU, is replaced rather than reused.
                keep = worker.alive and worker.cpu_used < self.limits.cpu_seconds_lifetime / 2 \
                    and not (self._isolate and reply.get("processes"))
                return _result(reply, time.monotonic() - started)
            except TimeoutError:
                return CallResult(failure=CallFailure("timeout", f"{function} took longer than {limit:g} s and was "
                                                                 "killed"), seconds=time.monotonic() - started)
            except _WorkerDied as died:
                return CallResult(failure=CallFailure("killed", f"{function} killed its worker: {died}"),
                                  seconds=time.monotonic() - started)
            finally:
                if keep and not self._closed:
                    self._idle.append(worker)
                else:
                    self._all.discard(worker)
                    await worker.kill()

    async def _exchange(self, worker: _Worker, line: bytes) -> dict[str, Any]:
        assert worker.process.stdin is not None and worker.process.stdout is not None
        try:
            worker.process.stdin.write(line)
            await worker.process.stdin.drain()
            raw = await worker.process.stdout.readline()
        except (BrokenPipeError, ConnectionResetError, ValueError) as error:
            raise _WorkerDied(type(error).__name__) from error
        if not raw:
            raise _WorkerDied(_exit_reason(await worker.process.wait()))
        reply: dict[str, Any] = json.loads(raw)
        worker.cpu_used = float(reply.get("cpu_used") or worker.cpu_used)
        return reply

    async def _spawn(self) -> _Worker:
        self.work_root.mkdir(parents=True, exist_ok=True)
        slot = next(self._spawned)
        tmp = self.work_root / f"worker-{slot}"
        tmp.mkdir(mode=0o700)
        uid = None if self._uid_base is None else self._uid_base + slot % 16
        if uid is not None:
            os.chown(tmp, uid, uid)
        config = {"tmp": str(tmp), "hidden": self.hidden_paths, "isolate": self._isolate, "uid": uid,
                  "limits": {"memory_bytes": self.limits.memory_bytes, "max_file_bytes": self.limits.max_file_bytes,
                             "max_processes": self.limits.max_processes, "temp_bytes": self.limits.temp_bytes,
                             "cpu_seconds_lifetime": self.limits.cpu_seconds_lifetime}}
        command = [sys.executable, "-m", "artlike_server.jobs.sandbox_worker", json.dumps(config)]
        if self._isolate:
            command = ["unshare", "--net", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc", *command]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "PYTHONNOUSERSITE": "1",
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        process = await asyncio.create_subprocess_exec(
            *command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL, env=env, cwd=tmp, start_new_session=True, limit=MAX_REPLY_BYTES)
        worker = _Worker(process, tmp)
        self._all.add(worker)
        assert process.stdout is not None
        try:
            ready = await asyncio.wait_for(process.stdout.readline(), START_TIMEOUT_S)
        except TimeoutError:
            ready = b""
        reply = json.loads(ready) if ready else {}
        if not reply.get("ok"):
            self._all.discard(worker)
            await worker.kill()
            reason = reply.get("message") or _exit_reason(process.returncode)
            raise SandboxUnavailable(f"a sandbox worker did not start: {reason}")
        return worker


class SandboxUnavailable(RuntimeError):
    """A worker could not start at all (not a user error): surfaces as a server error."""


class _WorkerDied(Exception):
    pass


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        name = signal.Signals(-code).name
        why = {"SIGKILL": "killed (memory, or the process limit)", "SIGXCPU": "CPU time limit exceeded"}.get(name, name)
        return f"the worker died: {why}"
    if code == 128 + signal.SIGKILL or code == 128 + signal.SIGXCPU:  # unshare reports its child's signal so
        return _exit_reason(-(code - 128))
    return f"the worker exited with status {code}"


def _result(reply: Mapping[str, Any], seconds: float) -> CallResult:
    if reply.get("ok"):
        return CallResult(value=reply.get("value"), seconds=seconds)
    return CallResult(failure=CallFailure(reply.get("kind", "raised"), str(reply.get("message", "")),
                                          reply.get("traceback")), seconds=seconds)
