"""The Tinker API's futures: every training or sampling operation is answered at once with a request id,
and the SDK polls `retrieve_future` for its outcome.

- `FutureTable` keeps each operation's outcome (JSON, protobuf bytes, or an error with the SDK's category
  "user" or "server") for `keep_s` after it completes, so a poll the network retried still finds it; a poll
  long-waits (up to `poll_s`) rather than making the SDK spin. An id this process never issued (the server
  restarted while the SDK waited) is answered as a failed operation, so no client hangs.
- `OrderedQueues` runs one run's operations strictly in the order the SDK numbered them (`seq_id`): the SDK
  sends `forward_backward` and `optim_step` back to back before awaiting either, and the chunks of a large
  `forward_backward` out of order. A repeated `(run, seq_id)` (an HTTP retry) gets the first request's id.
  A number that never arrives (a client that gave up on a submission) holds the queue `gap_timeout_s`, then
  the queue moves on to the next one it has.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from ..errors import APIError

log = logging.getLogger(__name__)

Payload = dict[str, Any] | bytes
Work = Callable[[], Awaitable[Payload]]


@dataclass
class Outcome:
    payload: Payload | None = None
    error: str | None = None
    category: Literal["user", "server"] = "server"

    def as_json(self) -> dict[str, Any]:
        return {"error": self.error, "category": self.category}


@dataclass
class _Entry:
    done: asyncio.Event = field(default_factory=asyncio.Event)
    outcome: Outcome | None = None


def outcome_of_error(error: BaseException) -> Outcome:
    """A failed operation as the SDK reads it: the caller's mistake ("user", not retried) or the server's."""
    if isinstance(error, APIError):
        return Outcome(error=error.message, category="user" if 400 <= error.status_code < 500 and
                       error.status_code not in (408, 409, 429) else "server")
    log.exception("a Tinker operation failed", exc_info=error)
    return Outcome(error=f"internal error: {type(error).__name__}: {error}", category="server")


class FutureTable:
    def __init__(self, *, keep_s: float = 3600.0, poll_s: float = 25.0) -> None:
        self._entries: dict[str, _Entry] = {}
        self._ids = itertools.count(1)
        self._prefix = f"{time.time_ns():x}"  # ids of an earlier process never match this one's
        self._keep_s = keep_s
        self._poll_s = poll_s
        self._tasks: set[asyncio.Task[None]] = set()
        self._finished: deque[tuple[float, str]] = deque()  # in the order they finished: the oldest go first

    def new_id(self) -> str:
        request_id = f"req-{self._prefix}-{next(self._ids)}"
        self._entries[request_id] = _Entry()
        return request_id

    def start(self, work: Work, request_id: str | None = None) -> str:
        """Run `work` in the background under `request_id` (default: a new one); the id at once."""
        request_id = request_id or self.new_id()
        task = asyncio.create_task(self.run(request_id, work))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return request_id

    async def run(self, request_id: str, work: Work) -> None:
        try:
            outcome = Outcome(payload=await work())
        except asyncio.CancelledError:
            self.finish(request_id, Outcome(error="the server stopped before this operation finished"))
            raise
        except Exception as error:
            outcome = outcome_of_error(error)
        self.finish(request_id, outcome)

    def finish(self, request_id: str, outcome: Outcome) -> None:
        entry = self._entries.get(request_id)
        if entry is None or entry.outcome is not None:
            return
        entry.outcome = outcome
        entry.done.set()
        self._finished.append((time.monotonic(), request_id))
        self._forget_old()

    async def wait(self, request_id: str, timeout_s: float | None = None) -> Outcome | None:
        """The outcome, waiting up to `timeout_s` (default `poll_s`); None while the operation still runs."""
        entry = self._entries.get(request_id)
        if entry is None:
            return Outcome(error=f"unknown request id {request_id!r}: the operation was lost (the server "
                           "restarted) or its result expired; submit it again", category="server")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(entry.done.wait(), self._poll_s if timeout_s is None else timeout_s)
        return entry.outcome

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _forget_old(self) -> None:
        horizon = time.monotonic() - self._keep_s
        while self._finished and self._finished[0][0] < horizon:
            self._entries.pop(self._finished.popleft()[1], None)


@dataclass
class _Queue:
    next_seq: int = 1  # the operation after the one that made the run (seq 0)
    waiting: dict[int, tuple[str, Work]] = field(default_factory=dict)
    issued: dict[int, str] = field(default_factory=dict)  # seq_id -> request id, for retried submissions
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    runner: asyncio.Task[None] | None = None


class OrderedQueues:
    def __init__(self, futures: FutureTable, *, gap_timeout_s: float = 120.0, remembered: int = 4096) -> None:
        self._futures = futures
        self._queues: dict[str, _Queue] = {}
        self._gap_timeout_s = gap_timeout_s
        self._remembered = remembered

    def submit(self, run: str, seq_id: int, work: Work) -> str:
        queue = self._queues.setdefault(run, _Queue())
        if seq_id in queue.issued:
            return queue.issued[seq_id]
        request_id = self._futures.new_id()
        queue.issued[seq_id] = request_id
        if len(queue.issued) > self._remembered:
            del queue.issued[min(queue.issued)]
        if seq_id < queue.next_seq:  # behind the queue: it ran the numbers after it already
            self._futures.finish(request_id, Outcome(
                error=f"operation {seq_id} arrived after operation {queue.next_seq - 1} of the same run had run",
                category="user"))
            return request_id
        queue.waiting[seq_id] = (request_id, work)
        queue.arrived.set()
        if queue.runner is None or queue.runner.done():
            queue.runner = asyncio.create_task(self._drain(run, queue))
        return request_id

    async def _drain(self, run: str, queue: _Queue) -> None:
        while queue.waiting:
            if queue.next_seq not in queue.waiting:
                queue.arrived.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(queue.arrived.wait(), self._gap_timeout_s)
                if queue.next_seq not in queue.waiting:
                    if queue.arrived.is_set():
                        continue  # another number arrived: look again
                    skipped, queue.next_seq = queue.next_seq, min(queue.waiting)
                    log.warning("Tinker run %s: operation %d never arrived; going on with %d", run, skipped,
                                queue.next_seq)
            request_id, work = queue.waiting.pop(queue.next_seq)
            queue.next_seq += 1
            await self._futures.run(request_id, work)

    async def stop(self) -> None:
        runners = [q.runner for q in self._queues.values() if q.runner is not None]
        for runner in runners:
            runner.cancel()
        await asyncio.gather(*runners, return_exceptions=True)
        for queue in self._queues.values():
            for request_id, _ in queue.waiting.values():
                self._futures.finish(request_id, Outcome(error="the server stopped before this operation ran"))
            queue.waiting.clear()
