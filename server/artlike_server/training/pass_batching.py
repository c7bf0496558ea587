"""Which training-session passes go to the trainer together: the waiting passes of several models become one
`passes` command (the worker fuses those it can: `torch_worker/fused_passes.py`).

The trainer runs one command at a time (the client's lock, FIFO, so every caller is served in turn). A pass
that gets the lock takes every other model's pass waiting by then (one per model, oldest first, at most
`max_passes`) into its command. No pass ever waits for others to arrive: that would hold the trainer idle,
and busy runs queue behind each other's passes anyway, so theirs fuse as they come (`bench/tinker_api.py`
measures several runs at once, fused and one by one).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

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
    def __init__(self, lock: asyncio.Lock, run: RunPasses, *, max_passes: int = 8) -> None:
        """`lock`: the trainer's command lock; `run` is called with it held."""
        if max_passes < 1:
            raise ValueError(f"max_passes must be at least 1, not {max_passes}")
        self._lock = lock
        self._run = run
        self._max_passes = max_passes
        self._waiting: list[_Waiting] = []
        self.passes = 0  # session passes run
        self.fused = 0  # of them, those that ran as one pass with another model's

    async def submit(self, command: protocol.Pass) -> protocol.PassDone:
        """Run `command` (alone or with other models' waiting passes) and return its answer."""
        waiting = _Waiting(command)
        self._waiting.append(waiting)
        try:
            async with self._lock:
                if not waiting.answer.done():  # else a pass that got the lock first took it along
                    await self._run_batch(self._take(waiting))
        finally:
            if not waiting.answer.done() and waiting in self._waiting:  # its caller stopped waiting
                self._waiting.remove(waiting)
        return await waiting.answer

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
        try:
            answers = await self._run([w.command for w in batch])
        except Exception as error:  # the command failed as a whole: so did each pass in it
            answers = [error] * len(batch)
        except BaseException:  # the caller was cancelled: the passes it carried are lost with it
            batch[0].answer.cancel()
            for waiting in batch[1:]:
                waiting.answer.set_exception(PassAbandoned("the trainer command this pass shared was abandoned"))
            raise
        self.passes += len(batch)
        self.fused += sum(1 for a in answers if isinstance(a, protocol.PassDone) and a.fused > 1)
        for waiting, answer in zip(batch, answers, strict=True):
            if isinstance(answer, BaseException):
                waiting.answer.set_exception(answer)
            else:
                waiting.answer.set_result(answer)
