"""The observer interface every tracker implements, the scalars of a history line, and the fan-out that routes
the server's history lines, managed jobs and exports to the trackers asked for."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

log = logging.getLogger(__name__)

SCALARS = ("reward.mean", "reward.std", "loss.mean", "kl.mean", "entropy.mean", "grad_norm.mean",
           "clip_fraction.mean", "logprob_mismatch", "groups_skipped", "trainable_tokens", "train_seconds",
           "swap_seconds",
           # why learning slows (rewarded groups): no-signal groups, pass distribution, length, entropy, drift
           "zero_variance_fraction", "groups_all_wrong", "groups_mixed", "groups_all_right", "pass_rate",
           "response_tokens_mean", "sampling_entropy", "kl_to_base.mean",
           # the settings a schedule or a control moves from step to step (`config/learning_rate`, ...)
           "config.learning_rate", "config.entropy_coef")


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


class Tracker(Protocol):
    """What a tracker is told, per trainable model. Calls come from the server's event loop or a worker
    thread, one at a time; a tracker that talks to the network queues (see `background`)."""

    def step(self, model: str, entry: dict[str, Any]) -> None:
        """A committed step's history line (its metrics: `step_scalars`)."""

    def evaluation(self, model: str, entry: dict[str, Any]) -> None:
        """An evaluation line of a committed step (`"event": "eval"`, its scores under `eval`)."""

    def train_config(self, model: str, job_id: str, config: dict[str, Any]) -> None:
        """The train config of a managed job that trains `model`, as it starts (or resumes)."""

    def alias_moved(self, model: str, step: int, reason: str) -> None:
        """The alias `model` serves step `step` from now on."""

    def exported(self, model: str, step: int, format: str, path: str) -> None:
        """Step `step` was exported as `format`; `path` names what was written."""

    def close(self) -> None:
        """Write what is pending and end every run."""


class Trackers:
    """The trackers asked for, as one: routes history lines by kind, and keeps a failing tracker from failing
    the step, job or export it reports on (the error is logged)."""

    def __init__(self, trackers: Sequence[Tracker]) -> None:
        self.trackers = list(trackers)

    def observe_history(self, model: str, entry: dict[str, Any]) -> None:
        """A `ModelManager` history observer: step lines, evaluations and alias moves."""
        event, step = entry.get("event"), entry.get("step")
        if event is None and isinstance(step, int):
            self._each("step", lambda tracker: tracker.step(model, entry))
            if entry.get("promoted", True):  # a held-back step leaves the alias where it was
                self._each("alias_moved", lambda tracker: tracker.alias_moved(model, step, "trained"))
        elif event == "eval":
            self._each("evaluation", lambda tracker: tracker.evaluation(model, entry))
        elif event == "alias" and isinstance(alias := entry.get("alias_step"), int):
            reason = str(entry.get("reason") or "set by API")
            self._each("alias_moved", lambda tracker: tracker.alias_moved(model, alias, reason))

    def train_config(self, model: str, job_id: str, config: dict[str, Any]) -> None:
        self._each("train_config", lambda tracker: tracker.train_config(model, job_id, config))

    def exported(self, model: str, step: int, format: str, path: str) -> None:
        self._each("exported", lambda tracker: tracker.exported(model, step, format, path))

    def close(self) -> None:
        self._each("close", lambda tracker: tracker.close())

    def _each(self, what: str, call: Callable[[Tracker], None]) -> None:
        for tracker in self.trackers:
            try:
                call(tracker)
            except Exception:  # a tracker never fails the step, job or export it reports on
                log.exception("the %s tracker failed on %s", type(tracker).__name__, what)
