"""`art.PipelineTrainer`'s scheduling: staleness bound, overlap, stopping rules, evaluation, resume.

The server is a small in-process stand-in (`FakeServer`: a served step that a training call advances after a
delay) so the pipeline's own logic can be checked with exact timings; tests/integration/test_pipeline.py runs
the pipeline against the real server, engine and trainer.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import artlike as art
from artlike._pipeline import staleness
from artlike.types import DoneEvent, StartEvent, StepEvent, StepRetention


@dataclass
class FakeServer:
    """What the pipeline needs of a TrainableModel: the served step, train(), evaluations and retention."""

    train_seconds: float = 0.05
    no_signal_calls: set[int] = field(default_factory=set)  # train calls (0-based) that find no signal
    name: str = "m"
    step: int = 0
    training: bool = False
    trained_batches: list[list[art.TrajectoryGroup]] = field(default_factory=list)
    evaluations: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    retention: StepRetention | None = None
    fail_train_at: int | None = None

    async def get_step(self) -> int:
        return self.step

    def train(self, groups: Iterable[art.TrajectoryGroup], *, config: Any, progress: bool) -> Any:
        return self._train(list(groups))

    async def _train(self, groups: list[art.TrajectoryGroup]) -> art.TrainResult:
        if self.fail_train_at is not None and self.step == self.fail_train_at:
            raise art.TrainingError("the trainer crashed", code="trainer_crashed")
        self.training = True
        await asyncio.sleep(self.train_seconds)
        self.training = False
        self.trained_batches.append(groups)
        if len(self.trained_batches) - 1 in self.no_signal_calls:
            done = DoneEvent(model=f"m@{self.step}", step=self.step, adapter_path=None, train_seconds=0.0,
                             swap_seconds=0.0, trained=False, reason="all groups have equal rewards")
            return art.TrainResult(step=self.step, model=done.model, metrics=[], start=None, done=done)
        self.step += 1
        start = StartEvent(model="m", from_step=self.step - 1, num_gradient_steps=1, trajectories=8, groups=len(groups),
                           groups_skipped=0, sequences=8, trainable_tokens=100, zero_variance_fraction=0.5,
                           groups_all_wrong=1, groups_mixed=1, groups_all_right=0, pass_rate=0.25,
                           response_tokens_mean=12.0, sampling_entropy=0.8)
        metric = StepEvent(gradient_step=1, num_gradient_steps=2, loss=0.5, policy_loss=0.5, kl=0.0, entropy=1.0,
                           grad_norm=1.0, clip_fraction=0.0, learning_rate=1e-5, tokens=100, seconds=0.01,
                           logprob_mismatch=0.02, kl_to_base=0.01, metrics={"clip_cov_fraction": 0.03, "nll": 2.0})
        second = metric.model_copy(update={"gradient_step": 2, "metrics": {"clip_cov_fraction": 0.01}})
        done = DoneEvent(model=f"m@{self.step}", step=self.step, adapter_path="/x", train_seconds=0.05,
                         swap_seconds=0.0)
        return art.TrainResult(step=self.step, model=done.model, metrics=[metric, second], start=start, done=done)

    async def set_retention(self, retention: StepRetention) -> None:
        self.retention = retention

    async def log_evaluation(self, step: int, metrics: dict[str, float]) -> dict[str, Any]:
        self.evaluations.append((step, metrics))
        return {}


@dataclass
class Rollouts:
    """A rollout function that records when each rollout ran relative to training."""

    server: FakeServer
    seconds: float = 0.01
    slow: dict[int, float] = field(default_factory=dict)  # scenario → seconds
    fail: set[int] = field(default_factory=set)
    started: list[tuple[int, int, bool]] = field(default_factory=list)  # (scenario, served step, training?)

    async def __call__(self, scenario: int) -> art.Trajectory:
        self.started.append((scenario, self.server.step, self.server.training))
        index = sum(1 for s, _, _ in self.started if s == scenario)  # 1, 2, ... within the group
        await asyncio.sleep(self.slow.get(scenario, self.seconds))
        if scenario in self.fail:
            raise RuntimeError(f"rollout of {scenario} broke")
        return art.Trajectory([{"role": "user", "content": str(scenario)}], reward=float(index % 2),
                              metrics={"correct": float(index % 2)})


def make(server: FakeServer, rollouts: Rollouts, scenarios: Iterable[int], **options: Any) -> art.PipelineTrainer[int]:
    options = {"group_size": 2, "groups_per_step": 2, "progress": False, **options}
    return art.PipelineTrainer(server, rollouts, scenarios, **options)  # type: ignore[arg-type]


def test_staleness_counts_from_the_oldest_sampling_step() -> None:
    assert staleness(5, [4, 5, 4]) == 1
    assert staleness(5, [5]) == 0
    assert staleness(3, [5]) == 0  # a rollback: never negative


def test_max_steps_off_policy_zero_is_the_sequential_loop() -> None:
    server = FakeServer()
    rollouts = Rollouts(server)
    result = make(server, rollouts, range(100), max_steps_off_policy=0).run_sync(num_steps=3)
    assert [s.step for s in result.steps] == [1, 2, 3]
    assert not any(training for _, _, training in rollouts.started)  # nothing sampled while training
    assert all(s.staleness_max == 0 for s in result.steps)
    assert len(rollouts.started) == 3 * 2 * 2  # exactly the rollouts the steps needed
    assert result.stopped == "num_steps"


def test_one_step_off_policy_overlaps_rollouts_with_training_and_bounds_staleness() -> None:
    server = FakeServer(train_seconds=0.1)
    rollouts = Rollouts(server, seconds=0.02)
    result = make(server, rollouts, range(100), max_steps_off_policy=1).run_sync(num_steps=4)
    assert any(training for _, _, training in rollouts.started)  # the next groups sampled during a step
    assert all(s.staleness_max <= 1 for s in result.steps)
    assert any(s.staleness_max == 1 for s in result.steps)
    for batch in server.trained_batches:
        for group in batch:
            for trajectory in group:
                assert "policy_step" in trajectory.metadata
    assert len(rollouts.started) == 4 * 2 * 2  # no rollouts beyond what the 4 steps train
    assert result.trainer_busy_fraction > 0.5  # the trainer rarely waits when rollouts are fast


def test_a_straggler_older_than_the_bound_is_dropped_and_replaced() -> None:
    server = FakeServer(train_seconds=0.05)
    rollouts = Rollouts(server, seconds=0.01, slow={0: 0.5})  # scenario 0's group finishes 2+ steps late
    result = make(server, rollouts, range(100), max_steps_off_policy=1).run_sync(num_steps=4)
    trained_scenarios = {int(t.messages()[0]["content"]) for batch in server.trained_batches for g in batch for t in g}
    assert 0 not in trained_scenarios
    assert sum(s.groups_dropped_stale for s in result.steps) == 1
    assert all(s.groups == 2 for s in result.steps)  # a replacement group filled the step

    server = FakeServer(train_seconds=0.05)
    rollouts = Rollouts(server, seconds=0.01, slow={0: 0.5})
    result = make(server, rollouts, range(100), max_steps_off_policy=1, stale="train").run_sync(num_steps=4)
    assert max(s.staleness_max for s in result.steps) >= 2  # trained anyway, and reported


def test_a_step_without_signal_is_reported_and_the_loop_goes_on() -> None:
    server = FakeServer(no_signal_calls={1})
    result = make(server, Rollouts(server), range(100)).run_sync(num_steps=3)
    assert [(s.from_step, s.step, s.trained) for s in result.steps] == [(0, 1, True), (1, 1, False), (1, 2, True)]
    assert result.steps[1].reason == "all groups have equal rewards"
    unreported = result.steps[1]  # no start event: counted from the groups' rewards
    assert unreported.zero_variance_fraction == unreported.zero_variance_groups / unreported.groups
    assert unreported.entropy is None and unreported.sampling_entropy is None  # the server measures these
    # The pass distribution by the config's pass_threshold (0.5): each group holds rewards 1 and 0.
    assert (unreported.groups_all_wrong, unreported.groups_mixed, unreported.groups_all_right,
            unreported.pass_rate) == (0, 2, 0, 0.5)
    server = FakeServer(no_signal_calls={0})
    trainer = make(server, Rollouts(server), range(100), pass_threshold=2.0)  # no reward reaches it
    refused = trainer.run_sync(num_steps=1).steps[0]
    assert (refused.groups_all_wrong, refused.groups_mixed, refused.groups_all_right, refused.pass_rate) == (2, 0, 0, 0)


def test_reports_carry_rewards_metrics_mismatch_and_timings() -> None:
    server = FakeServer()
    steps: list[art.PipelineStep] = []
    result = make(server, Rollouts(server), range(100), on_step=steps.append).run_sync(num_steps=2)
    assert steps == result.steps
    report = result.steps[0]
    assert report.trajectories == 4 and report.groups == 2
    assert report.reward_mean == pytest.approx(0.5) and report.metrics == {"correct": pytest.approx(0.5)}
    assert report.logprob_mismatch == pytest.approx(0.02) and report.loss == pytest.approx(0.5)
    assert (report.zero_variance_fraction, report.groups_all_wrong, report.groups_mixed, report.groups_all_right,
            report.pass_rate, report.response_tokens_mean, report.sampling_entropy) == (0.5, 1, 1, 0, 0.25, 12.0, 0.8)
    assert report.entropy == pytest.approx(1.0) and report.kl_to_base == pytest.approx(0.01)
    # the objective's own statistics: each averaged over the gradient steps that reported it
    assert report.objective_metrics == {"clip_cov_fraction": pytest.approx(0.02), "nll": 2.0}
    assert report.train_seconds >= 0.05 and report.rollout_seconds > 0 and report.step_seconds >= report.train_seconds


def test_failed_rollouts_raise_past_the_budget_and_thin_groups_are_dropped() -> None:
    server = FakeServer()
    with pytest.raises(RuntimeError, match="rollout of 1 broke"):
        make(server, Rollouts(server, fail={1}), range(100)).run_sync(num_steps=2)

    server = FakeServer()
    result = make(server, Rollouts(server, fail={1}), range(100), max_exceptions=0.5).run_sync(num_steps=2)
    assert sum(s.groups_dropped_failed for s in result.steps) == 1  # both of its rollouts failed
    assert all(s.groups == 2 for s in result.steps)


def test_score_group_rewrites_groups_and_none_drops_them() -> None:
    server = FakeServer()

    async def judge(group: art.TrajectoryGroup) -> art.TrajectoryGroup | None:
        if group.trajectories[0].messages()[0]["content"] == "0":
            return None
        for n, trajectory in enumerate(group):
            trajectory.reward = 10.0 + n
        return group

    result = make(server, Rollouts(server), range(100), score_group=judge).run_sync(num_steps=2)
    assert result.steps[0].groups_dropped_failed == 1
    assert result.steps[0].reward_mean == pytest.approx(10.5)


def test_the_scenarios_running_out_trains_the_last_partial_batch() -> None:
    server = FakeServer()
    result = make(server, Rollouts(server), range(3)).run_sync(num_steps=10)
    assert [s.groups for s in result.steps] == [2, 1]
    assert result.stopped == "scenarios_exhausted"


def test_max_seconds_stops_after_the_step_in_progress() -> None:
    server = FakeServer(train_seconds=0.05)
    result = make(server, Rollouts(server, seconds=0.02), range(10_000)).run_sync(max_seconds=0.4)
    assert result.stopped == "max_seconds"
    assert 1 <= len(result.steps) < 10
    assert result.wall_seconds < 1.5


def test_evaluation_tracks_the_best_step_and_keeps_it() -> None:
    server = FakeServer()
    scores = {0: 0.2, 2: 0.9, 4: 0.5}

    async def evaluate(step: int) -> dict[str, float]:
        return {"accuracy": scores.get(step, 0.0)}

    trainer = make(server, Rollouts(server), range(100), evaluate=evaluate, eval_every=2, eval_metric="accuracy",
                   keep_last=2)
    result = trainer.run_sync(num_steps=5)
    assert [step for step, _ in server.evaluations] == [0, 2, 4, 5]  # baseline, every 2 steps, the end
    assert result.best_step == 2 and result.best_value == pytest.approx(0.9)
    assert result.steps[1].eval == {"accuracy": 0.9} and result.steps[1].best_step == 2
    assert result.steps[4].eval == {"accuracy": 0.0}
    assert server.retention is not None and server.retention.keep_last == 2
    assert server.retention.keep_best is not None and server.retention.keep_best.metric == "eval.accuracy"

    with pytest.raises(KeyError, match="eval_metric 'reward'"):
        make(FakeServer(), Rollouts(server), range(100), evaluate=evaluate, eval_every=1).run_sync(num_steps=1)


def test_a_crashed_run_resumes_from_its_state_file(tmp_path: Path) -> None:
    state = tmp_path / "pipeline.json"
    server = FakeServer(fail_train_at=2)
    rollouts = Rollouts(server)
    with pytest.raises(art.TrainingError):
        make(server, rollouts, range(100), state_path=state, max_steps_off_policy=0).run_sync(num_steps=5)
    saved = json.loads(state.read_text())
    assert saved["steps_done"] == 2 and saved["served_step"] == 2
    used_before = {s for batch in server.trained_batches for g in batch for s in [int(g.trajectories[0].messages()[0]["content"])]}

    server.fail_train_at = None
    rollouts = Rollouts(server)
    result = make(server, rollouts, range(100), state_path=state, max_steps_off_policy=0).run_sync(num_steps=5)
    assert [s.index for s in result.steps] == [1, 2, 3, 4, 5]  # the earlier reports are kept
    assert [s.step for s in result.steps[2:]] == [3, 4, 5]
    assert not used_before & {scenario for scenario, _, _ in rollouts.started}  # used scenarios are skipped

    with pytest.raises(ValueError, match="model 'm'"):
        other = FakeServer(name="other")
        make(other, Rollouts(other), range(100), state_path=state).run_sync(num_steps=1)


def test_bad_options_fail_before_anything_runs() -> None:
    server = FakeServer()
    with pytest.raises(ValueError, match="group_size"):
        make(server, Rollouts(server), [], group_size=0)
    with pytest.raises(ValueError, match="eval_every needs"):
        make(server, Rollouts(server), [], eval_every=2)
    with pytest.raises(ValueError):
        make(server, Rollouts(server), [], learning_rate=-1.0)  # the training options are validated now
