"""The text graders' work runs here, off the event loop: a small pool of worker processes it can kill.

ROUGE-L builds an n×m table in pure Python, the format grader's regexes can backtrack quadratically, and
math-verify can spend unbounded time in C code (its own SIGALRM limit cannot interrupt that, and works in
the main thread only). Each such call (`artlike.graders.run_leaf`) goes to a worker (`grader_worker.py`,
under an address-space limit); one that runs past `timeout_s` is killed with its process group and a fresh
worker takes its place on the next call. string_check stays inline: `in` and `casefold` are linear, so under
the size cap it costs microseconds. Every text, inline or not, is held to `max_text_chars`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

from artlike.graders import GradingFailed, LeafFunction, run_leaf

from .worker_ready import read_ready_line

log = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0  # importing the metric packages (sympy for math-verify) on a busy machine
MAX_REPLY_BYTES = 1 << 20
INLINE: frozenset[str] = frozenset({"string_check"})


@dataclass(frozen=True)
class GraderLimits:
    timeout_s: float = 5.0  # wall clock of one grader computation in a worker
    workers: int = 2
    memory_bytes: int = 1 << 30  # RLIMIT_AS of a worker
    max_text_chars: int = 20_000  # each text a grader compares: the sample, a rendered input or reference


class GraderTimedOut(Exception):
    """A grader computation ran past its time limit; its worker was killed."""


class GraderInputTooLarge(Exception):
    """A text to grade is over `max_text_chars` (refused before any work)."""


class GraderWorkerFailed(GradingFailed):
    """A worker could not compute the grade (out of memory, a missing metric package, it died): that sample
    scores 0 with the reason."""


class GraderPoolUnavailable(RuntimeError):
    """No worker could be started: a server fault, not the grader's."""


class _Worker:
    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    async def kill(self) -> None:
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        await self.process.wait()


class GraderPool:
    def __init__(self, limits: GraderLimits = GraderLimits()) -> None:
        self.limits = limits
        self._slots = asyncio.Semaphore(limits.workers)
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()
        self._closed = False
        self.killed = 0  # workers killed for running past the time limit

    @property
    def worker_pids(self) -> list[int]:
        return [worker.process.pid for worker in self._all]

    def check_text(self, text: str, what: str) -> None:
        if len(text) > self.limits.max_text_chars:
            raise GraderInputTooLarge(f"{what} is {len(text):,} characters; graders take at most "
                                      f"{self.limits.max_text_chars:,} (--max-grader-chars)")

    async def compute(self, function: LeafFunction, args: list[str]) -> Any:
        """`run_leaf(function, args)` in a worker (string_check inline). Raises GraderTimedOut,
        GraderInputTooLarge, or GraderWorkerFailed (a GradingFailed: the grade's error)."""
        for text in args:
            self.check_text(text, f"a {function.replace('_', ' ')} grader's text")
        if function in INLINE:
            return run_leaf(function, args)
        if self._closed:
            raise GraderPoolUnavailable("the grader pool is closed")
        line = json.dumps({"function": function, "args": args}).encode() + b"\n"
        async with self._slots:
            worker = self._idle.pop() if self._idle else await self._spawn()
            keep = False
            started = time.monotonic()
            try:
                reply = await asyncio.wait_for(self._exchange(worker, line), self.limits.timeout_s)
            except TimeoutError:
                self.killed += 1
                log.warning("a %s grader ran past %g s; its worker was killed", function, self.limits.timeout_s)
                raise GraderTimedOut(f"the {function.replace('_', ' ')} grader took longer than "
                                     f"{self.limits.timeout_s:g} s (--grader-timeout) and was stopped") from None
            else:
                keep = reply.get("ok") is True or reply.get("error") not in ("MemoryError", "_died")
            finally:
                if keep and not self._closed:
                    self._idle.append(worker)
                else:
                    self._all.discard(worker)
                    await worker.kill()
        if not reply.get("ok"):
            error, message = reply.get("error"), reply.get("message")
            if error == "MemoryError":
                message = f"out of memory (a grader worker may use {self.limits.memory_bytes >> 20} MiB)"
            raise GraderWorkerFailed(f"the {function.replace('_', ' ')} grader failed after "
                                     f"{time.monotonic() - started:.1f} s: {error}: {message}")
        return reply.get("value")

    async def _exchange(self, worker: _Worker, line: bytes) -> dict[str, Any]:
        process = worker.process
        assert process.stdin is not None and process.stdout is not None
        try:
            process.stdin.write(line)
            await process.stdin.drain()
            raw = await process.stdout.readline()
        except (BrokenPipeError, ConnectionResetError, ValueError) as error:
            return {"ok": False, "error": "_died", "message": f"the grader worker died ({type(error).__name__})"}
        if not raw:
            code = await process.wait()
            why = signal.Signals(-code).name if code < 0 else f"status {code}"
            return {"ok": False, "error": "_died", "message": f"the grader worker exited ({why})"}
        reply: dict[str, Any] = json.loads(raw)
        return reply

    async def _spawn(self) -> _Worker:
        config = json.dumps({"memory_bytes": self.limits.memory_bytes})
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "PYTHONNOUSERSITE": "1",
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
               # one thread each: BLAS thread pools reserve address space the memory limit counts
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "artlike_server.jobs.grader_worker", config, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, env=env, start_new_session=True,
            limit=MAX_REPLY_BYTES)
        worker = _Worker(process)
        self._all.add(worker)
        if not (await read_ready_line(process, START_TIMEOUT_S)).get("ok"):
            self._all.discard(worker)
            await worker.kill()
            raise GraderPoolUnavailable(f"a grader worker did not start (exit status {process.returncode})")
        return worker

    async def close(self) -> None:
        self._closed = True
        for worker in list(self._all):
            await worker.kill()
        self._all.clear()
        self._idle.clear()
