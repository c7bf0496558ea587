"""Per-step metrics as TensorBoard event files (`--tensorboard-dir`): one run directory per model, one
point per committed step, written from the step's history line (the same numbers as the studio's charts).

TensorBoard's own event-file writer does the writing (no TensorFlow, and unlike tensorboardX it never imports
torch, which the server process must not); it is imported only when the option is set.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SCALARS = ("reward.mean", "reward.std", "loss.mean", "kl.mean", "entropy.mean", "grad_norm.mean",
           "clip_fraction.mean", "logprob_mismatch", "groups_skipped", "trainable_tokens", "train_seconds",
           "swap_seconds")


def step_scalars(entry: dict[str, Any]) -> Iterator[tuple[str, float]]:
    """(tag, value) for each metric of a history line that is a number, plus tokens/s."""
    for path in SCALARS:
        value: Any = entry
        for part in path.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if isinstance(value, int | float) and not isinstance(value, bool):
            yield path.replace(".mean", "").replace(".", "/"), float(value)
    if entry.get("train_seconds"):
        yield "tokens_per_second", entry.get("trainable_tokens", 0) / entry["train_seconds"]
    for key, value in (entry.get("metrics") or {}).items():
        if isinstance(value, int | float):
            yield f"metrics/{key}", float(value)
    for key, value in (entry.get("objective_metrics") or {}).items():  # e.g. PPO's score_mean, kl_coef
        if isinstance(value, int | float):
            yield f"objective/{key}", float(value)
    for key, value in (entry.get("eval") or {}).items():  # an evaluation line (`"event": "eval"`)
        if isinstance(value, int | float):
            yield f"eval/{key}", float(value)


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

    def close(self) -> None:
        with self._lock:
            for writer in self._writers.values():
                writer.close()
            self._writers.clear()
