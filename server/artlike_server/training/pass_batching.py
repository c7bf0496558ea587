"""Which training-session passes go to the trainer together: the waiting passes of several models become one
`passes` command (the worker fuses those it can: `torch_worker/fused_passes.py`).

The trainer runs one command at a time (the client's lock, FIFO, so every caller is served in turn). A pass
that gets the lock takes every other model's pass waiting by then (one per model, oldest first, at most
`max_passes`) into its command. Runs that train side by side alternate `forward_backward` and
`optim_step`, so when one run's pass gets the lock, the other run is usually just between its optimizer step
and its next pass: taking only what waits, their passes would alternate and never meet. So a pass waits,
without holding the lock (the other run's optimizer step runs meanwhile), for its partners: the models of the
last fused pass, or, after a pass that ran while another model's pass waited for it, that pass's models. It
waits at most `window_fraction` of the last pass's seconds (up to `max_window_s`). A partner that does not
come within the window is not waited for again until it has shared a pass again: a run that stopped, or one
that spends its time sampling, costs the others at most one window. A model alone on the trainer never
waits, nor does one whose passes the worker could not fuse (its objective's), nor do others wait for it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from artlike_server.trainer_ipc import protocol

RunPasses = Callable[[Sequence[protocol.Pass]], Awaitable[Sequence[protocol.PassDone | BaseException]]]
"""Runs passes as one worker command (the caller holds the trainer's lock); each pass's answer or error."""


class PassAbandoned(RuntimeError):
    """A pass was in a command that its sender abandoned (cancelled, e.g. as the server stops)."""


@dataclass
class _Waiting:
    command: protocol.Pass
    answer: asyncio.Future[protocol.PassDone] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class PassBatcher:
    def __init__(self, lock: asyncio.Lock, run: RunPasses, *, max_passes: int = 8, window_fraction: float = 0.25,
                 max_window_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        """`lock`: the trainer's command lock; `run` is called with it held."""
        if max_passes < 1:
            raise ValueError(f"max_passes must be at least 1, not {max_passes}")
        self._lock = lock
        self._run = run
        self._max_passes = max_passes
        self._window_fraction = window_fraction
        self._max_window_s = max_window_s
        self._clock = clock
        self._waiting: list[_Waiting] = []
        self._partners: set[str] = set()  # the models a pass waits for (module docstring)
        self._solo: set[str] = set()  # models whose last pass among others did not fuse
        self._last_seconds = 0.0  # how long the last pass took
        self._arrived = asyncio.Event()
        self.passes = 0  # session passes run
        self.fused = 0  # of them, those that ran as one pass with another model's

    async def submit(self, command: protocol.Pass) -> protocol.PassDone:
        """Run `command` (alone or with other models' waiting passes) and return its answer."""
        waiting = _Waiting(command)
        self._waiting.append(waiting)
        self._wake()
        deadline: float | None = None
        try:
            while not waiting.answer.done():
                async with self._lock:
                    if waiting.answer.done():
                        break
                    missing = self._missing_partners(command.model_name)
                    now = self._clock()
                    if missing and deadline is None:
                        deadline = now + min(self._max_window_s, self._window_fraction * self._last_seconds)
                    if not missing or deadline is None or now >= deadline:
                        self._partners -= missing  # they did not come: not waited for until they share again
                        await self._run_batch(self._take(waiting))
                        continue
                await self._until(waiting.answer, deadline - self._clock())
        finally:
            if not waiting.answer.done() and waiting in self._waiting:  # its caller stopped waiting
                self._waiting.remove(waiting)
        return waiting.answer.result()

    def _missing_partners(self, model: str) -> set[str]:
        """The partners a pass of `model` would wait for: those without a pass waiting now."""
        if model in self._solo:
            return set()
        return self._partners - self._solo - {w.command.model_name for w in self._waiting} - {model}

    def _take(self, first: _Waiting) -> list[_Waiting]:
        """`first` and the oldest waiting pass of every other model, up to `max_passes`."""
        batch = [first]
        for waiting in self._waiting:
            if len(batch) >= self._max_passes:
                break
            if all(waiting.command.model_name != taken.command.model_name for taken in batch):
                batch.append(waiting)
        for waiting in batch:
            self._waiting.remove(waiting)
        return batch

    async def _run_batch(self, batch: list[_Waiting]) -> None:
        """Run `batch` (its first pass is the caller's) and answer each of its passes."""
        started = self._clock()
        try:
            answers = await self._run([w.command for w in batch])
        except Exception as error:  # the command failed as a whole: so did each pass in it
            answers = [error] * len(batch)
        except BaseException:  # the caller was cancelled: the passes it carried are lost with it
            batch[0].answer.cancel()
            for waiting in batch[1:]:
                waiting.answer.set_exception(PassAbandoned("the trainer command this pass shared was abandoned"))
            raise
        finally:
            self._wake()
        self._last_seconds = self._clock() - started
        models = {w.command.model_name for w in batch}
        fused = {w.command.model_name for w, a in zip(batch, answers, strict=True)
                 if isinstance(a, protocol.PassDone) and a.fused > 1}  # fmt: skip
        self.passes += len(batch)
        self.fused += len(fused)
        if len(batch) > 1:
            self._solo = (self._solo - fused) | {w.command.model_name for w, a in zip(batch, answers, strict=True)
                                                 if isinstance(a, protocol.PassDone) and a.fused == 1}  # fmt: skip
        if len(fused) > 1:
            self._partners = fused
        elif {w.command.model_name for w in self._waiting} - models:
            self._partners = models - self._solo
        else:
            self._partners = set()
        for waiting, answer in zip(batch, answers, strict=True):
            if isinstance(answer, BaseException):
                waiting.answer.set_exception(answer)
            else:
                waiting.answer.set_result(answer)

    def _wake(self) -> None:
        """Tell the passes waiting for partners that the queue changed."""
        self._arrived.set()
        self._arrived = asyncio.Event()

    async def _until(self, answer: asyncio.Future[protocol.PassDone], seconds: float) -> None:
        """Wait until `answer` is given, another pass arrives or a pass ends, or `seconds` pass."""
        arrived = asyncio.ensure_future(self._arrived.wait())
        either: list[asyncio.Future[Any]] = [answer, arrived]
        try:
            await asyncio.wait(either, timeout=max(0.0, seconds), return_when=asyncio.FIRST_COMPLETED)
        finally:
            arrived.cancel()
