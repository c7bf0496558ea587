"""Experiment trackers: history lines, a managed job's train config, alias moves and an export go to every
tracker asked for, and W&B (offline) and MLflow (a file store) hold the history lines' values, read back with
their own formats."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from artlike_server.trackers.background import BackgroundTracker
from artlike_server.trackers.base import Tracker, Trackers, step_scalars

from tests.tracker_records import mlflow_run, read_until, wandb_run

STEP_1 = {"step": 1, "from_step": 0, "time": 1700000000.0, "reward": {"mean": 0.5, "std": 0.25}, "loss": {"mean": -0.1},
          "kl": {"mean": 0.002}, "entropy": {"mean": 1.5}, "clip_fraction": {"mean": 0.0}, "groups_skipped": 0,
          "trainable_tokens": 120, "train_seconds": 2.0, "swap_seconds": 0.05, "metrics": {"accuracy": 0.5},
          "objective_metrics": {"kl_coef": 0.05}, "config": {"learning_rate": 1e-5, "entropy_coef": 0.001}, "promoted": True,
          "zero_variance_fraction": 0.25, "groups_all_wrong": 1, "groups_mixed": 3, "groups_all_right": 0,
          "pass_rate": 0.375, "response_tokens_mean": 14.5, "sampling_entropy": 0.9, "kl_to_base": {"mean": 0.004}}
STEP_2 = {**STEP_1, "step": 2, "from_step": 1, "time": 1700000100.0, "reward": {"mean": 0.75, "std": 0.1},
          "config": {"learning_rate": 1e-5, "entropy_coef": 0.006}, "promoted": False}
EVALUATION = {"event": "eval", "step": 1, "split": "validation", "eval": {"accuracy": 0.625}, "time": 1700000200.0}
ALIAS = {"event": "alias", "alias_step": 2, "previous_step": 1, "reason": "promoted by hand", "time": 1700000300.0}
JOB_CONFIG = {"method": "reinforcement", "learning_rate": 2e-5, "iterations": 3, "rollout": {"group_size": 4}}


def feed(trackers: Trackers) -> None:
    for line in (STEP_1, STEP_2, EVALUATION, ALIAS):
        trackers.observe_history("m", line)
    trackers.train_config("m", "ftjob-1", JOB_CONFIG)
    trackers.exported("m", 2, "peft", "m-step2-peft.tar")
    trackers.observe_history("other", {**STEP_1, "reward": {"mean": 0.9, "std": 0.0}})
    trackers.close()


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def step(self, model: str, entry: dict[str, Any]) -> None:
        self.calls.append(("step", model, entry["step"]))

    def evaluation(self, model: str, entry: dict[str, Any]) -> None:
        self.calls.append(("evaluation", model, entry["step"]))

    def train_config(self, model: str, job_id: str, config: dict[str, Any]) -> None:
        self.calls.append(("train_config", model, job_id))

    def alias_moved(self, model: str, step: int, reason: str) -> None:
        self.calls.append(("alias_moved", model, step, reason))

    def exported(self, model: str, step: int, format: str, path: str) -> None:
        self.calls.append(("exported", model, step, format, path))

    def close(self) -> None:
        self.calls.append(("close",))


class Broken(Recorder):
    def step(self, model: str, entry: dict[str, Any]) -> None:
        raise RuntimeError("the tracker's server is down")


def test_step_scalars_include_the_plateau_diagnostics() -> None:
    scalars = dict(step_scalars(STEP_1))
    assert {key: scalars[key] for key in ("zero_variance_fraction", "groups_all_wrong", "groups_mixed",
                                          "groups_all_right", "pass_rate", "response_tokens_mean",
                                          "sampling_entropy", "kl_to_base", "entropy")} == {
        "zero_variance_fraction": 0.25, "groups_all_wrong": 1.0, "groups_mixed": 3.0, "groups_all_right": 0.0,
        "pass_rate": 0.375, "response_tokens_mean": 14.5, "sampling_entropy": 0.9, "kl_to_base": 0.004,
        "entropy": 1.5}
    # the settings a schedule or the entropy control moves, as the step trained with them
    assert (scalars["config/learning_rate"], scalars["config/entropy_coef"]) == (1e-5, 0.001)
    assert dict(step_scalars(STEP_2))["config/entropy_coef"] == 0.006


def test_history_lines_are_routed_by_kind_and_a_failing_tracker_fails_nothing() -> None:
    recorder, background = Recorder(), Recorder()
    trackers: list[Tracker] = [Broken(), recorder, BackgroundTracker(background, "test")]
    feed(Trackers(trackers))
    expected = [("step", "m", 1), ("alias_moved", "m", 1, "trained"), ("step", "m", 2),  # step 2 held back
                ("evaluation", "m", 1), ("alias_moved", "m", 2, "promoted by hand"), ("train_config", "m", "ftjob-1"),
                ("exported", "m", 2, "peft", "m-step2-peft.tar"), ("step", "other", 1),
                ("alias_moved", "other", 1, "trained"), ("close",)]
    assert recorder.calls == expected and background.calls == expected


def test_weights_and_biases_offline_run_holds_the_history_lines(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    from artlike_server.trackers.weights_and_biases import WandbTracker

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    feed(Trackers([BackgroundTracker(WandbTracker("artlike-test", run_name_prefix="t-"), "wandb")]))

    run = read_until(lambda: wandb_run(tmp_path, "t-m"), lambda run: "export/step2/peft" in run["summary"])
    rows = {row["step"]: row for row in run["history"] if "reward" in row}
    for line in (STEP_1, STEP_2):
        assert {k: rows[line["step"]][k] for k, _ in step_scalars(line)} == pytest.approx(dict(step_scalars(line)))
    assert [row["eval/accuracy"] for row in run["history"] if "eval/accuracy" in row] == [0.625]
    assert [(row["step"], row["alias/step"]) for row in run["history"] if "alias/step" in row] == [(1, 1), (2, 2)]
    assert run["config"]["model"] == "m" and run["config"]["jobs"] == {"ftjob-1": JOB_CONFIG}
    assert run["summary"]["alias/reason"] == "promoted by hand"
    assert run["summary"]["export/step2/peft"] == "m-step2-peft.tar"
    other = read_until(lambda: wandb_run(tmp_path, "t-other"), lambda run: len(run["history"]) >= 2)
    assert [row["reward"] for row in other["history"] if "reward" in row] == [0.9]


def test_mlflow_file_store_holds_the_history_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mlflow")
    from artlike_server.trackers.mlflow_runs import MlflowTracker, metric_name

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow's opt-in to its file store
    uri = (tmp_path / "mlruns").as_uri()
    feed(Trackers([BackgroundTracker(MlflowTracker(uri, "artlike"), "mlflow")]))

    run = mlflow_run(uri, "m")
    for line in (STEP_1, STEP_2):
        assert {k: run["metrics"][metric_name(k)][line["step"]] for k, _ in step_scalars(line)} == \
            pytest.approx(dict(step_scalars(line)))
    assert run["metrics"]["eval/accuracy"] == {1: 0.625}
    assert run["metrics"]["alias/step"] == {1: 1, 2: 2}
    assert run["tags"]["alias.reason"] == "promoted by hand"
    assert run["tags"]["export/step2/peft"] == "m-step2-peft.tar"
    assert run["params"] == {"ftjob-1/iterations": "3", "ftjob-1/learning_rate": "2e-05",
                             "ftjob-1/method": "reinforcement", "ftjob-1/rollout": '{"group_size": 4}'}
    assert run["status"] == "FINISHED"
    assert mlflow_run(uri, "other")["metrics"]["reward/mean"] == {1: 0.9}
    # A restarted server finds the model's run again instead of starting another.
    again = MlflowTracker(uri, "artlike")
    again.step("m", {**STEP_1, "step": 3})
    again.close()
    assert sorted(mlflow_run(uri, "m")["metrics"]["reward/mean"]) == [1, 2, 3]


def test_a_jobs_train_config_leaves_out_the_rewards_code() -> None:
    from artlike_server.jobs.service import train_config
    from artlike_server.jobs.spec import JobSpec, PythonReward

    spec = JobSpec(api="openai", method="reinforcement", base_model="base", target_model="m", create_target=True,
                   reward=PythonReward(source="def grade(sample, item):\n    return 1.0\n", entry="grade"),
                   iterations=3, train_rows=8, learning_rate=2e-5)
    config = train_config(spec)
    assert "source" not in config["reward"] and config["reward"]["entry"] == "grade" and config["learning_rate"] == 2e-5
    assert (config["iterations"], config["method"], config["target_model"]) == (3, "reinforcement", "m")
