"""User code (reward functions, python graders, tools, next_turn) runs here: never in the server process.

Each call runs in a worker process (`sandbox_worker.py`) started in new network, mount and pid namespaces:
no network at all (even 127.0.0.1 is unreachable), the data dir hidden under an empty tmpfs, a private
size-bounded tmpfs on /tmp as the only writable place, /proc showing only its own processes, no privileges.
How depends on who the server is, decided once at start by actually starting a worker (`Isolation`):

    root     namespaces made as root; user code runs as an unused uid of its own (sandbox_host.py)
    userns   any other user, in a user namespace of its own: no capabilities, every mount read-only, the
             server user's home hidden but for Python's files
    none     no isolation is possible: user code is refused (SandboxUnavailable, 503 `sandbox_unavailable`)
             unless the operator passed --unsafe-user-code

Everywhere: rlimits on address space, CPU time (re-armed per call), processes, file size and open files,
and, where a cgroup is writable, the whole worker's memory and process count. Workers are never shared:
each belongs to one owner (a job) and one source, and is retired after any failure; a call without an owner
gets a worker of its own. The per-call wall-clock timeout is the parent's: the worker's process group is
killed (with a pid namespace, everything it forked dies with it). `enforcement()` says which of these hold.

`check_program` compiles user code in the server to report syntax errors at request time; it never runs it.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import hashlib
import itertools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from ..errors import ServiceUnavailable
from .sandbox_host import CgroupParent, WorkerCgroup, find_cgroup_parent, free_uid_range
from .worker_ready import read_ready_line

log = logging.getLogger(__name__)

FailureKind = Literal["raised", "timeout", "killed", "unserializable", "load_failed"]
Mode = Literal["root", "userns", "none"]
MAX_REPLY_BYTES = 16 << 20
START_TIMEOUT_S = 30.0
UNSHARE = ["--net", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc"]
OPT_IN = "--unsafe-user-code"
_probed: dict[tuple[int, str | None], Isolation] = {}  # (euid, unshare) -> what a probe found
_instances = itertools.count()


@dataclass(frozen=True)
class SandboxLimits:
    call_timeout_s: float = 10.0  # wall clock per call, enforced by the parent
    memory_bytes: int = 1 << 30  # a whole worker (cgroup), else split over its processes' RLIMIT_AS
    cpu_seconds_per_call: int = 30  # RLIMIT_CPU, re-armed before each call
    cpu_seconds_lifetime: int = 3600  # a worker is replaced once it has used half of this
    max_processes: int = 16  # processes and threads of a worker, with a cgroup
    processes_without_cgroup: int = 4  # without one: fewer, each with memory_bytes / this of address space
    max_file_bytes: int = 16 << 20  # RLIMIT_FSIZE
    temp_bytes: int = 64 << 20  # the private /tmp (a tmpfs) holds at most this much
    workers: int = 2  # calls running at once
    idle_workers: int = 8  # workers kept warm for their owner's next call


@dataclass(frozen=True)
class Isolation:
    """How workers are isolated here, found by starting one; `missing` says why not when mode is none."""

    mode: Mode
    missing: str | None = None
    cgroup: CgroupParent | None = None
    uids: range | None = None  # as root: the unused uids workers run as

    @classmethod
    def unavailable(cls, why: str) -> Isolation:
        return cls("none", missing=why)


class SandboxUnavailable(ServiceUnavailable):
    """User code cannot run: no isolation here (and no opt-in), or a worker did not start."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retry_after=60, code="sandbox_unavailable")


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


class _Worker:
    def __init__(self, process: asyncio.subprocess.Process, tmp: Path, uid: int | None,
                 cgroup: WorkerCgroup | None) -> None:
        self.process = process
        self.tmp = tmp
        self.uid = uid
        self.cgroup = cgroup
        self.cpu_used = 0.0

    @property
    def alive(self) -> bool:
        return self.process.returncode is None

    async def kill(self) -> None:
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        await self.process.wait()
        if self.cgroup is not None:
            await asyncio.to_thread(self.cgroup.kill_and_remove)
        shutil.rmtree(self.tmp, ignore_errors=True)


class Sandbox:
    def __init__(self, work_root: Path, *, hidden_paths: Sequence[Path] = (), limits: SandboxLimits = SandboxLimits(),
                 allow_unsafe: bool = False, isolation: Isolation | None = None) -> None:
        self.work_root = work_root
        self.hidden_paths = [str(Path(p).resolve()) for p in hidden_paths]
        self.limits = limits
        self.allow_unsafe = allow_unsafe
        self.isolation = isolation if isolation is not None else self._probe()
        self._free_uids = list(self.isolation.uids or ())
        self._slots = asyncio.Semaphore(limits.workers)
        self._idle: dict[tuple[str, str], list[_Worker]] = {}
        self._all: set[_Worker] = set()
        self._retiring: set[asyncio.Task[None]] = set()
        self._serial = itertools.count()
        self._spawned = itertools.count()
        self._closed = False

    # ------------------------------------------------------------------------------ what holds here

    @property
    def isolated(self) -> bool:
        return self.isolation.mode != "none"

    def refusal(self) -> str | None:
        """Why user code is refused here, or None when it may run."""
        if self.isolated or self.allow_unsafe:
            return None
        return (f"user code (reward functions, python graders, tools, next_turn) is refused: this server cannot "
                f"isolate it ({self.isolation.missing}). Run the server as root with util-linux `unshare`, or as a "
                f"user who may create user namespaces, or start it with {OPT_IN} to run user code as the "
                "server's own user, with its network and files")

    def require(self) -> None:
        """Raise SandboxUnavailable (503) when user code may not run here."""
        refusal = self.refusal()
        if refusal is not None:
            raise SandboxUnavailable(refusal)

    def enforcement(self) -> dict[str, str]:
        mode = self.isolation.mode
        isolated = mode != "none"
        cgroup = self.isolation.cgroup
        processes = max_processes(self.isolation, self.limits)
        per_process = memory_per_process(self.isolation, self.limits) >> 20
        if not isolated:
            user_code = f"UNSAFE: runs unisolated ({OPT_IN})" if self.allow_unsafe else \
                f"refused: {self.isolation.missing}"
        else:
            user_code = "isolated"
        return {
            "isolation": mode,
            "user_code": user_code,
            "network": "enforced (network namespace)" if isolated else "NOT enforced",
            "data_dir": "hidden (mount namespace)" if isolated else "NOT hidden",
            "writable": f"a private {self.limits.temp_bytes >> 20} MiB /tmp only" if isolated
            else "private temp dir as cwd; other paths per file permissions",
            "uid": {"root": "an unused uid per worker", "userns": "the server's, without capabilities, in a user "
                    "namespace of its own"}.get(mode, "the server's uid" if os.geteuid() else "an unused uid per worker"),
            "processes": f"{processes} per worker" if processes is not None else "NOT limited",
            "memory": (f"{self.limits.memory_bytes >> 20} MiB per worker ({cgroup.describe()})" if cgroup is not None
                       else f"{per_process} MiB address space per process, {processes or 'unlimited'} processes"),
            "cpu": f"{self.limits.cpu_seconds_per_call} s per call",
            "wall_clock": f"{self.limits.call_timeout_s:g} s per call",
            "sharing": "a worker per job and source, retired after any failure",
        }

    @property
    def worker_uids(self) -> range:
        """The uids this sandbox's workers run as (empty when they keep the server's)."""
        return self.isolation.uids or range(0)

    def _probe(self) -> Isolation:
        """Start a worker in each mode this user might have, best first; the first that answers a call wins.
        Once per process and user (sandboxes in one process differ only in their uids)."""
        root = os.geteuid() == 0
        uids = free_uid_range(os.getpid() * 8 + next(_instances)) if root else None
        unshare = shutil.which("unshare")
        known = _probed.get((os.geteuid(), unshare))
        if known is None:
            known = _probed[(os.geteuid(), unshare)] = self._find_mode(unshare, uids)
        return replace(known, uids=uids)

    def _find_mode(self, unshare: str | None, uids: range | None) -> Isolation:
        root = uids is not None
        if unshare is None:
            return Isolation("none", missing="util-linux `unshare` is not on PATH", uids=uids)
        reasons = []
        cgroup = find_cgroup_parent() if root else None
        # Root never takes the user namespace path: mapped to uid 0, its workers would escape RLIMIT_NPROC.
        candidates = [Isolation("root", uids=uids, cgroup=cgroup)] if root else [Isolation("userns")]
        if cgroup is not None:  # a cgroup that cannot be joined is not worth refusing user code for
            candidates.append(Isolation("root", uids=uids))
        for isolation in candidates:
            why = self._try(isolation)
            if why is None:
                return isolation
            reasons.append(f"{isolation.mode}: {why}")
        return Isolation("none", missing="; ".join(reasons), uids=uids)

    def _try(self, isolation: Isolation) -> str | None:
        """None when a worker in this mode starts and answers one call, else why not."""
        self.work_root.mkdir(parents=True, exist_ok=True)
        tmp = self.work_root / f"probe-{os.getpid()}"
        tmp.mkdir(mode=0o700, exist_ok=True)
        uid = isolation.uids.start if isolation.uids is not None else None
        if uid is not None:
            os.chown(tmp, uid, uid)
        cgroup = None
        request = json.dumps({"id": 0, "source": "def f():\n    return 'ok'\n", "function": "f", "args": [],
                              "kwargs": {}, "cpu_seconds": 5}) + "\n"
        try:
            if isolation.cgroup is not None:
                cgroup = WorkerCgroup(isolation.cgroup, f"artlike-sandbox-{os.getpid()}-probe",
                                      self.limits.memory_bytes, self.limits.max_processes + 1)
            command, env = worker_command(isolation, worker_config(isolation, self, tmp, uid, cgroup))
            done = subprocess.run(command, input=request.encode(), capture_output=True, env=env, cwd=tmp,
                                  timeout=START_TIMEOUT_S, start_new_session=True)
        except subprocess.TimeoutExpired:
            return "the worker did not answer"
        except OSError as error:
            return str(error)
        finally:
            if cgroup is not None:
                cgroup.kill_and_remove()
            shutil.rmtree(tmp, ignore_errors=True)
        replies = [json.loads(line) for line in done.stdout.splitlines() if line.startswith(b"{")]
        if len(replies) == 2 and replies[1].get("value") == "ok":
            return None
        if replies and not replies[0].get("ok"):
            return str(replies[0].get("message"))
        return (done.stderr.decode(errors="replace").strip().splitlines() or [f"exit status {done.returncode}"])[-1]

    # ------------------------------------------------------------------------------------- calls

    async def start(self) -> None:
        self.work_root.mkdir(parents=True, exist_ok=True)

    async def close(self) -> None:
        self._closed = True
        await asyncio.gather(*self._retiring)
        for worker in list(self._all):
            await self._retire(worker)
        self._idle.clear()
        shutil.rmtree(self.work_root, ignore_errors=True)

    async def release(self, owner: str) -> None:
        """The owner (a job) is done: its idle workers go."""
        for key in [key for key in self._idle if key[0] == owner]:
            for worker in self._idle.pop(key):
                await self._retire(worker)

    async def call(self, source: str, function: str, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
                   *, owner: str | None = None, timeout_s: float | None = None) -> CallResult:
        """Run `function(*args, **kwargs)` of `source` in a worker of `owner` for this source (None: a worker
        of its own). Failures of the user's code come back as `CallResult.failure`; arguments that are not
        JSON raise TypeError (a bug of the caller); SandboxUnavailable when user code may not run here."""
        if self._closed:
            raise RuntimeError("the sandbox is closed")
        self.require()
        limit = timeout_s or self.limits.call_timeout_s
        request = {"id": next(self._serial), "source": source, "function": function, "args": list(args),
                   "kwargs": dict(kwargs or {}), "cpu_seconds": self.limits.cpu_seconds_per_call}
        line = json.dumps(request, allow_nan=True).encode() + b"\n"  # TypeError here: the caller's bug
        key = (owner, hashlib.sha256(source.encode()).hexdigest()) if owner is not None else None
        async with self._slots:
            started = time.monotonic()
            idle = self._idle.get(key, []) if key is not None else []
            worker = idle.pop() if idle else await self._spawn()
            keep = False
            try:
                reply = await asyncio.wait_for(self._exchange(worker, line), limit)
                # Only a worker whose call succeeded, left no process behind and used little CPU is reused.
                keep = bool(reply.get("ok")) and worker.alive and not reply.get("processes") \
                    and worker.cpu_used < self.limits.cpu_seconds_lifetime / 2
                return _result(reply, time.monotonic() - started)
            except TimeoutError:
                return CallResult(failure=CallFailure("timeout", f"{function} took longer than {limit:g} s and was "
                                                                 "killed"), seconds=time.monotonic() - started)
            except _WorkerDied as died:
                return CallResult(failure=CallFailure("killed", f"{function} killed its worker: {died}"),
                                  seconds=time.monotonic() - started)
            finally:
                if keep and key is not None and not self._closed:
                    await self._park(key, worker)
                else:  # in the background: the caller has its answer, the kill and cleanup need not delay it
                    retiring = asyncio.create_task(self._retire(worker))
                    self._retiring.add(retiring)
                    retiring.add_done_callback(self._retiring.discard)

    async def _park(self, key: tuple[str, str], worker: _Worker) -> None:
        self._idle.setdefault(key, []).append(worker)
        idle = sum(len(workers) for workers in self._idle.values())
        while idle > self.limits.idle_workers:  # the least recently parked of another key goes first
            oldest = next((k for k in self._idle if k != key and self._idle[k]), key)
            await self._retire(self._idle[oldest].pop(0))
            if not self._idle[oldest]:
                del self._idle[oldest]
            idle -= 1

    async def _retire(self, worker: _Worker) -> None:
        self._all.discard(worker)
        await worker.kill()
        if worker.uid is not None:
            self._free_uids.append(worker.uid)

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
        while self.isolation.uids is not None and not self._free_uids and self._idle:
            key = next(iter(self._idle))  # every uid is taken: an idle worker of another owner gives its up
            await self._retire(self._idle[key].pop(0))
            if not self._idle[key]:
                del self._idle[key]
        slot = next(self._spawned)
        tmp = self.work_root / f"worker-{slot}"
        tmp.mkdir(mode=0o700)
        if self.isolation.uids is not None and not self._free_uids:
            raise SandboxUnavailable(f"all {len(self.isolation.uids)} sandbox uids are in use: lower --reward-workers")
        uid = self._free_uids.pop(0) if self.isolation.uids is not None else None
        if uid is not None:
            os.chown(tmp, uid, uid)
        cgroup = None
        if self.isolation.cgroup is not None:
            cgroup = WorkerCgroup(self.isolation.cgroup, f"artlike-sandbox-{os.getpid()}-{slot}",
                                  self.limits.memory_bytes, self.limits.max_processes + 1)  # + the supervisor
        command, env = worker_command(self.isolation, worker_config(self.isolation, self, tmp, uid, cgroup))
        process = await asyncio.create_subprocess_exec(
            *command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL, env=env, cwd=tmp, start_new_session=True, limit=MAX_REPLY_BYTES)
        worker = _Worker(process, tmp, uid, cgroup)
        self._all.add(worker)
        reply = await read_ready_line(process, START_TIMEOUT_S)
        if not reply.get("ok"):
            await self._retire(worker)
            reason = reply.get("message") or _exit_reason(process.returncode)
            raise SandboxUnavailable(f"a sandbox worker did not start: {reason}")
        return worker


def max_processes(isolation: Isolation, limits: SandboxLimits) -> int | None:
    if isolation.cgroup is not None:
        return limits.max_processes
    if isolation.mode != "none" or isolation.uids is not None:
        return limits.processes_without_cgroup
    return None  # the server's own uid: its RLIMIT_NPROC would count the server's processes too


def rlimit_nproc(isolation: Isolation, limits: SandboxLimits) -> int | None:
    """RLIMIT_NPROC of the executor. In a user namespace it counts the namespace's tasks, `unshare` and the
    supervisor among them; as root it counts the worker's own uid, which only the executor and its children use."""
    processes = max_processes(isolation, limits)
    return processes + 2 if processes is not None and isolation.mode == "userns" else processes


def memory_per_process(isolation: Isolation, limits: SandboxLimits) -> int:
    """RLIMIT_AS: the whole budget with a cgroup (which bounds the sum), else the budget split over processes."""
    if isolation.cgroup is not None:
        return limits.memory_bytes
    return limits.memory_bytes // (max_processes(isolation, limits) or 1)


def worker_config(isolation: Isolation, sandbox: Sandbox, tmp: Path, uid: int | None,
                  cgroup: WorkerCgroup | None) -> dict[str, Any]:
    home = str(Path.home())
    limits = sandbox.limits
    return {"tmp": str(tmp), "hidden": sandbox.hidden_paths, "mode": isolation.mode, "uid": uid,
            # In a user namespace the worker is the server's own user: its home is not the worker's to read.
            "masked": [home] if isolation.mode == "userns" and home != "/" else [],
            "cgroup_procs": cgroup.procs_files if cgroup is not None else [],
            "limits": {"memory_bytes": memory_per_process(isolation, limits), "max_file_bytes": limits.max_file_bytes,
                       "max_processes": rlimit_nproc(isolation, limits), "temp_bytes": limits.temp_bytes,
                       "cpu_seconds_lifetime": limits.cpu_seconds_lifetime}}


def worker_command(isolation: Isolation, config: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    command = [sys.executable, "-m", "artlike_server.jobs.sandbox_worker", json.dumps(config)]
    if isolation.mode == "root":
        command = ["unshare", *UNSHARE, *command]
    elif isolation.mode == "userns":
        command = ["unshare", "--user", "--map-root-user", *UNSHARE, *command]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "PYTHONNOUSERSITE": "1",
           "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    return command, env


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
