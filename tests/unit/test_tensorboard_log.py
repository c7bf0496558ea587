"""`--tensorboard-dir`: each committed step's history line becomes scalars, read back with TensorBoard's reader."""

from __future__ import annotations

from pathlib import Path

import pytest
from artlike_server.trackers.base import step_scalars
from artlike_server.trackers.tensorboard import TensorBoardLog
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

LINE = {"step": 2, "time": 1700000000.0, "reward": {"mean": 0.25, "std": 0.1}, "loss": {"mean": -0.5},
        "kl": {"mean": 0.01}, "clip_fraction": {"mean": 0.0}, "groups_skipped": 1, "trainable_tokens": 300,
        "train_seconds": 3.0, "metrics": {"accuracy": 0.75}, "objective_metrics": {"kl_coef": 0.05},
        "config": {"learning_rate": 1e-5}}


def test_step_scalars_of_a_history_line() -> None:
    scalars = dict(step_scalars(LINE))
    assert scalars == {"reward": 0.25, "reward/std": 0.1, "loss": -0.5, "kl": 0.01, "clip_fraction": 0.0,
                       "groups_skipped": 1.0, "trainable_tokens": 300.0, "train_seconds": 3.0,
                       "tokens_per_second": 100.0, "metrics/accuracy": 0.75, "objective/kl_coef": 0.05,
                       "config/learning_rate": 1e-5}
    evaluation = {"event": "eval", "step": 3, "split": "validation", "eval": {"accuracy": 0.5}, "time": 1.0}
    assert dict(step_scalars(evaluation)) == {"eval/accuracy": 0.5}


def test_steps_are_written_per_model_and_alias_lines_are_skipped(tmp_path: Path) -> None:
    log = TensorBoardLog(tmp_path)
    log.write_step("m", {"step": 1, "reward": {"mean": 0.5}})
    log.write_step("m", {"event": "alias", "alias_step": 0})  # not a step: nothing to draw
    log.write_step("m", LINE)
    log.write_step("other", {"step": 1, "reward": {"mean": 0.9}})
    log.close()
    runs = {}
    for model in ("m", "other"):
        accumulator = EventAccumulator(str(tmp_path / model))
        accumulator.Reload()
        runs[model] = [(e.step, e.value) for e in accumulator.Scalars("reward")]
    assert runs["m"] == [(1, 0.5), (2, 0.25)] and runs["other"] == [(1, pytest.approx(0.9))]
