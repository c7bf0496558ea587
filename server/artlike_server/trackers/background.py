"""A tracker that does its work on its own thread: W&B and MLflow may talk to a server over the network, and
starting a run takes seconds, so their calls leave the event loop at once and run in order on one thread."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from .base import Tracker

log = logging.getLogger(__name__)

CLOSE_WAIT_S = 60.0  # at shutdown, how long pending writes and run ends may take before they are left


class BackgroundTracker:
    def __init__(self, tracker: Tracker, name: str) -> None:
        self.tracker = tracker
        self._calls: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=f"tracker-{name}", daemon=True)
        self._thread.start()

    def step(self, model: str, entry: dict[str, Any]) -> None:
        self._calls.put(lambda: self.tracker.step(model, entry))

    def evaluation(self, model: str, entry: dict[str, Any]) -> None:
        self._calls.put(lambda: self.tracker.evaluation(model, entry))

    def train_config(self, model: str, job_id: str, config: dict[str, Any]) -> None:
        self._calls.put(lambda: self.tracker.train_config(model, job_id, config))

    def alias_moved(self, model: str, step: int, reason: str) -> None:
        self._calls.put(lambda: self.tracker.alias_moved(model, step, reason))

    def exported(self, model: str, step: int, format: str, path: str) -> None:
        self._calls.put(lambda: self.tracker.exported(model, step, format, path))

    def close(self) -> None:
        """Let the pending calls run, then close the tracker (waits up to `CLOSE_WAIT_S`)."""
        self._calls.put(self.tracker.close)
        self._calls.put(None)
        self._thread.join(CLOSE_WAIT_S)
        if self._thread.is_alive():
            log.warning("the %s tracker did not finish its writes in %.0f s; they are left",
                        type(self.tracker).__name__, CLOSE_WAIT_S)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every call queued so far has run; False if `timeout` passed first."""
        done = threading.Event()
        self._calls.put(done.set)
        return done.wait(timeout)

    def _work(self) -> None:
        while (call := self._calls.get()) is not None:
            try:
                call()
            except Exception:  # a tracker never fails what it reports on; the next call still runs
                log.exception("the %s tracker failed", type(self.tracker).__name__)
