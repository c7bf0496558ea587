"""Per-step metrics as TensorBoard event files (`--tensorboard-dir`): one run directory per model, one
point per committed step, written from the step's history line (the same numbers as the studio's charts).

TensorBoard's own event-file writer does the writing (no TensorFlow, and unlike tensorboardX it never imports
torch, which the server process must not); it is imported only when the option is set.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from .base import step_scalars

log = logging.getLogger(__name__)


class TensorBoardLog:
    def __init__(self, directory: Path) -> None:
        # The optional dependency, imported only when asked for.
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary, self._writer_type = Event, Summary, EventFileWriter
        self.directory = directory
        self._writers: dict[str, Any] = {}
        self._lock = threading.Lock()

    def write_step(self, model: str, entry: dict[str, Any]) -> None:
        step = entry.get("step")
        if not isinstance(step, int):
            return
        values = [self._summary.Value(tag=tag, simple_value=value) for tag, value in step_scalars(entry)]
        with self._lock:
            writer = self._writers.get(model)
            if writer is None:
                writer = self._writers[model] = self._writer_type(str(self.directory / model))
            writer.add_event(self._event(wall_time=entry.get("time", time.time()), step=step,
                                         summary=self._summary(value=values)))
            writer.flush()

    def step(self, model: str, entry: dict[str, Any]) -> None:
        self.write_step(model, entry)

    def evaluation(self, model: str, entry: dict[str, Any]) -> None:
        self.write_step(model, entry)  # its scores as `eval/*` scalars at the evaluated step

    def train_config(self, model: str, job_id: str, config: dict[str, Any]) -> None:
        """Event files hold scalars here; a job's config stays in its job and the history lines."""

    def alias_moved(self, model: str, step: int, reason: str) -> None:
        """Not a scalar of a step: the history lines and the studio show alias moves."""

    def exported(self, model: str, step: int, format: str, path: str) -> None:
        """Not a scalar of a step."""

    def close(self) -> None:
        with self._lock:
            for writer in self._writers.values():
                writer.close()
            self._writers.clear()
