"""The pipeline's options against a plateau: schedules, dynamic sampling, the pass-rate curriculum (worked
examples of their pure math), the pipeline applying them (on test_pipeline's in-process server), and the
GRPO family's entropy bonus."""

from __future__ import annotations

import doctest
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from artlike_server.torch_worker.objectives import PolicyBatch, build_objective
from artlike_server.torch_worker.objectives import tokens as token_math
from pydantic import ValidationError

import artlike as art
from artlike import _remedies
from artlike.types import CISPOConfig, GRPOConfig, GSPOConfig, ImportanceSamplingConfig, train_config

from .test_pipeline import FakeServer, make


def test_doctests() -> None:
    assert doctest.testmod(_remedies, raise_on_error=True).attempted >= 8
    assert doctest.testmod(token_math, raise_on_error=True).attempted >= 2


# ----------------------------------------------------------------------------------------------- schedules


def test_a_linear_schedule_goes_from_start_to_end_and_stays() -> None:
    temperature = art.Schedule(start=1.3, end=0.7, steps=6)
    assert [round(temperature.at(s), 3) for s in range(8)] == [1.3, 1.2, 1.1, 1.0, 0.9, 0.8, 0.7, 0.7]


def test_a_cosine_schedule_with_warmup_is_a_run_level_learning_rate() -> None:
    # warmup 2: 1e-5·1/3, 1e-5·2/3; then cosine from 1e-5 to 1e-6 over 4 steps: ½(1 − cos(π·k/4)) of the way
    lr = art.Schedule(start=1e-5, end=1e-6, steps=4, shape="cosine", warmup_steps=2)
    expected = [1e-5 / 3, 2e-5 / 3, 1e-5, 1e-5 - 9e-6 * 0.1464466, 5.5e-6, 1e-6 + 9e-6 * 0.1464466, 1e-6, 1e-6]
    assert [lr.at(s) for s in range(8)] == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ValueError, match="step"):
        lr.at(-1)


def test_a_group_size_schedule_rounds_and_never_drops_below_one() -> None:
    assert [art.Schedule(start=2, end=8, steps=3).at_int(s) for s in range(4)] == [2, 4, 6, 8]
    assert art.Schedule(start=0.2, end=0.1, steps=1).at_int(0) == 1
    with pytest.raises(ValidationError):
        art.Schedule(start=1, end=2, steps=0)


# -------------------------------------------------------------------------------------- dynamic sampling


def test_dynamic_sampling_bounds() -> None:
    assert art.DynamicSampling().signal_groups_wanted(8) == 8
    assert art.DynamicSampling(min_signal_groups=3).signal_groups_wanted(8) == 3
    assert art.DynamicSampling(max_resample_factor=1.5).max_groups_examined(4) == 6
    assert art.DynamicSampling(max_resample_factor=1.0).max_groups_examined(4) == 4
    with pytest.raises(ValidationError):
        art.DynamicSampling(max_resample_factor=0.5)


def test_has_signal_ignores_unscored_rollouts() -> None:
    assert _remedies.has_signal([None, 1.0, 0.0])
    assert not _remedies.has_signal([None, 1.0, 1.0])


# ------------------------------------------------------------------------------------------- curriculum


def test_the_curriculum_explores_unseen_scenarios_first_then_prefers_mixed_ones() -> None:
    sampler = art.CurriculumSampler(["easy", "mixed", "hard", "new"], art.PassRateCurriculum(explore=0.0))
    assert sorted(sampler.draw() for _ in range(4)) == [0, 1, 2, 3]
    sampler.record(0, [1.0, 1.0, 1.0])
    sampler.record(1, [1.0, 0.1, 0.1, 1.0])
    sampler.record(2, [0.1, 0.0])
    assert [sampler.pass_rate(k) for k in ("easy", "mixed", "hard", "new")] == [1.0, 0.5, 0.0, None]
    assert {sampler.draw() for _ in range(20)} == {1}
    assert sampler.distribution() == {"unseen": 1, "all_wrong": 1, "mixed": 1, "all_right": 1}


def test_the_pass_rate_is_recent_and_uses_the_threshold() -> None:
    sampler = art.CurriculumSampler([0], art.PassRateCurriculum(window=4, pass_threshold=0.5))
    sampler.record(0, [0.0, 0.0, 0.0, 0.0])
    sampler.record(0, [0.6, 0.5, None])  # two passes push two failures out of the window
    assert sampler.pass_rate(0) == 0.5


def test_while_unseen_scenarios_remain_a_share_of_draws_revisits_mixed_ones() -> None:
    # A pool larger than the run: without revisits, the curriculum would never draw a mixed scenario again.
    sampler = art.CurriculumSampler(list(range(10_000)), art.PassRateCurriculum(revisit=0.25, explore=0.0, seed=1))
    mixed = sampler.draw()
    sampler.record(mixed, [1.0, 0.0])
    drawn = [sampler.draw() for _ in range(2000)]
    assert drawn.count(mixed) == pytest.approx(500, abs=80)  # 1/4 of draws; the rest unseen, each once
    others = [d for d in drawn if d != mixed]
    assert len(set(others)) == len(others)
    sampler.record(mixed, [1.0] * 16)  # solved: no mixed scenario is left, so draws are unseen ones only
    assert mixed not in {sampler.draw() for _ in range(200)}


def test_revisit_zero_sees_the_whole_pool_first() -> None:
    sampler = art.CurriculumSampler(list(range(50)), art.PassRateCurriculum(revisit=0.0, explore=0.0))
    first = sampler.draw()
    sampler.record(first, [1.0, 0.0])
    assert sorted([first] + [sampler.draw() for _ in range(49)]) == list(range(50))
    assert sampler.draw() == first


def test_without_mixed_scenarios_the_curriculum_draws_from_the_whole_pool() -> None:
    sampler = art.CurriculumSampler(["a", "b"], art.PassRateCurriculum(explore=0.0, seed=3))
    sampler.draw(), sampler.draw()
    sampler.record(0, [1.0]), sampler.record(1, [0.0])
    assert {sampler.draw() for _ in range(40)} == {0, 1}
    with pytest.raises(ValueError, match="at least one"):
        art.CurriculumSampler([], art.PassRateCurriculum())


# ---------------------------------------------------------------------------------- the pipeline applies them


@dataclass
class RecordingServer(FakeServer):
    configs: list[Any] = field(default_factory=list)

    def train(self, groups: Any, *, config: Any, progress: bool) -> Any:
        self.configs.append(config)
        return super().train(groups, config=config, progress=progress)


@dataclass
class ScriptedRollouts:
    """Scenario s: reward 1 on every rollout when s is in `solved`, 0 when in `failed`, else alternating 1, 0
    within its group."""

    solved: set[int] = field(default_factory=set)
    failed: set[int] = field(default_factory=set)
    calls: dict[int, int] = field(default_factory=dict)
    temperatures: list[float] = field(default_factory=list)

    async def __call__(self, scenario: int) -> art.Trajectory:
        self.calls[scenario] = self.calls.get(scenario, 0) + 1
        self.temperatures.append(art.rollout_temperature(default=-1.0))
        reward = 1.0 if scenario in self.solved else 0.0 if scenario in self.failed else float(self.calls[scenario] % 2)
        return art.Trajectory([{"role": "user", "content": str(scenario)}], reward=reward)


def scenarios_of(batches: list[list[art.TrajectoryGroup]]) -> list[list[int]]:
    return [[int(g.trajectories[0].messages()[0]["content"]) for g in batch] for batch in batches]


def test_dynamic_sampling_trains_only_groups_with_variance_and_counts_the_dropped() -> None:
    server = RecordingServer()
    rollouts = ScriptedRollouts(solved={0, 2, 3})
    result = make(server, rollouts, range(100), max_steps_off_policy=0,  # type: ignore[arg-type]
                  dynamic_sampling=art.DynamicSampling()).run_sync(num_steps=2)
    assert scenarios_of(server.trained_batches) == [[1, 4], [5, 6]]
    assert [s.zero_variance_groups for s in result.steps] == [3, 0]


def test_dynamic_sampling_stops_looking_at_its_bound() -> None:
    server = RecordingServer()
    rollouts = ScriptedRollouts(solved=set(range(100)))  # never any signal
    result = make(server, rollouts, range(100), max_steps_off_policy=0,  # type: ignore[arg-type]
                  dynamic_sampling=art.DynamicSampling(max_resample_factor=1.5)).run_sync(num_steps=2)
    # 2 groups a step, bound 3: two dropped, the third trained (without signal) so the loop goes on
    assert [len(batch) for batch in server.trained_batches] == [1, 1]
    assert [s.zero_variance_groups for s in result.steps] == [2, 2]


def test_the_curriculum_draws_again_from_the_pool_and_prefers_mixed_scenarios() -> None:
    server = RecordingServer()
    rollouts = ScriptedRollouts(solved={0, 1})
    pool = [0, 1, 2]
    result = make(server, rollouts, pool, max_steps_off_policy=0,  # type: ignore[arg-type]
                  curriculum=art.PassRateCurriculum(explore=0.0, revisit=0.0), scenario_key=str).run_sync(num_steps=4)
    assert result.stopped == "num_steps"  # a pool is never exhausted
    drawn = [s for batch in scenarios_of(server.trained_batches) for s in batch]
    # every scenario first (the 4th draw may precede the 3rd's outcome), then only the mixed one
    assert set(drawn[:4]) == {0, 1, 2} and drawn[4:] == [2] * 4


def test_schedules_reach_the_rollouts_and_the_train_calls() -> None:
    server = RecordingServer()
    rollouts = ScriptedRollouts()
    make(server, rollouts, range(100), max_steps_off_policy=0,  # type: ignore[arg-type]
         temperature=art.Schedule(start=1.2, end=0.8, steps=2),
         group_size_schedule=art.Schedule(start=2, end=4, steps=2),
         learning_rate_schedule=art.Schedule(start=1e-5, end=5e-6, steps=2),
         learning_rate=3e-5).run_sync(num_steps=3)
    assert [len(g) for batch in server.trained_batches for g in batch] == [2, 2, 3, 3, 4, 4]
    assert rollouts.temperatures == pytest.approx([1.2] * 4 + [1.0] * 6 + [0.8] * 8)
    assert [c.learning_rate for c in server.configs] == pytest.approx([1e-5, 7.5e-6, 5e-6])
    assert all(c.objective == "grpo" for c in server.configs)


def test_without_a_temperature_schedule_the_rollout_gets_its_default() -> None:
    server = RecordingServer()
    rollouts = ScriptedRollouts()
    make(server, rollouts, range(100)).run_sync(num_steps=1)  # type: ignore[arg-type]
    assert set(rollouts.temperatures) == {-1.0}


def reference(scenario: int) -> art.Trajectory:
    return art.Trajectory(messages_and_choices=[{"role": "user", "content": str(scenario)},
                                                {"role": "assistant", "content": "the answer"}], reward=1.0)


def test_a_guide_adds_its_reference_only_to_groups_no_rollout_of_which_passed() -> None:
    server = RecordingServer()
    rollouts = ScriptedRollouts(solved={1}, failed={0, 2})  # 3: one rollout of two passes
    asked: list[int] = []

    def guide(scenario: int) -> art.Trajectory | None:
        asked.append(scenario)
        return None if scenario == 2 else reference(scenario)  # no reference for 2: trained as it is

    result = make(server, rollouts, range(100), max_steps_off_policy=0, guide=guide).run_sync(num_steps=2)  # type: ignore[arg-type]
    assert sorted(asked) == [0, 2]
    trained = {int(g.trajectories[0].messages()[0]["content"]): g for batch in server.trained_batches for g in batch}
    assert {s: len(g) for s, g in trained.items()} == {0: 3, 1: 2, 2: 2, 3: 2}
    added = trained[0].trajectories[-1]
    assert added.metadata["guide"] is True and added.reward == 1.0 and added.messages()[-1]["content"] == "the answer"
    assert [s.groups_guided for s in result.steps] == [1, 0]
    # the step's rewards are the rollouts' (0, 0 | 1, 1), not the reference's
    assert result.steps[0].reward_mean == pytest.approx(0.5) and result.steps[0].trajectories == 4


def test_an_async_guide_is_awaited_and_a_reference_needs_a_reward() -> None:
    server = RecordingServer()

    async def guide(scenario: int) -> art.Trajectory:
        return reference(scenario)

    result = make(server, ScriptedRollouts(failed={0, 1}), range(100), max_steps_off_policy=0,  # type: ignore[arg-type]
                  guide=guide).run_sync(num_steps=1)
    assert result.steps[0].groups_guided == 2

    def unrewarded(scenario: int) -> art.Trajectory:
        return art.Trajectory(messages_and_choices=[{"role": "assistant", "content": "x"}])

    server = RecordingServer()
    with pytest.raises(TypeError, match="with its reward"):
        make(server, ScriptedRollouts(failed={0}), range(100), max_steps_off_policy=0,  # type: ignore[arg-type]
             guide=unrewarded).run_sync(num_steps=1)


def test_a_guide_follows_the_configs_pass_threshold() -> None:
    server = RecordingServer()
    rollouts = ScriptedRollouts()  # every group: rewards 1, 0
    result = make(server, rollouts, range(100), max_steps_off_policy=0, guide=reference,  # type: ignore[arg-type]
                  pass_threshold=1.5).run_sync(num_steps=1)  # no reward reaches it: every group is guided
    assert result.steps[0].groups_guided == 2


@dataclass
class SureAndWrong:
    """Scenario s in `stuck`: every rollout at temperature below `hot` fails (reward 0); at `hot` or above, the
    `passing`-th rollout of each hot batch passes. Other scenarios: rewards alternate 1, 0."""

    stuck: set[int]
    hot: float = 1.5
    passing: int = 2
    temperatures: list[tuple[int, float]] = field(default_factory=list)
    hot_calls: dict[int, int] = field(default_factory=dict)

    async def __call__(self, scenario: int) -> art.Trajectory:
        temperature = art.rollout_temperature(1.0)
        self.temperatures.append((scenario, temperature))
        if scenario not in self.stuck:
            reward = float(sum(s == scenario for s, _ in self.temperatures) % 2)
        elif temperature < self.hot:
            reward = 0.0
        else:
            self.hot_calls[scenario] = self.hot_calls.get(scenario, 0) + 1
            reward = float(self.hot_calls[scenario] % self.passing == 0) if self.passing else 0.0
        return art.Trajectory([{"role": "user", "content": str(scenario)}], reward=reward, metrics={"hot": temperature})


def test_a_group_that_failed_everywhere_is_retried_hotter_and_a_passing_retry_joins_it() -> None:
    server = RecordingServer()
    rollouts = SureAndWrong(stuck={0})
    result = make(server, rollouts, range(100), max_steps_off_policy=0,  # type: ignore[arg-type]
                  retry_failed=art.RetryFailedGroups(temperature=1.5)).run_sync(num_steps=2)
    trained = {int(g.trajectories[0].messages()[0]["content"]): g for batch in server.trained_batches for g in batch}
    # scenario 0: its two rollouts at temperature 1 failed, its retry of two at 1.5 (the second passed) joined
    assert [t.reward for t in trained[0].trajectories] == [0.0, 0.0, 0.0, 1.0]
    assert [t.metadata.get("retry_temperature") for t in trained[0].trajectories] == [None, None, 1.5, 1.5]
    assert sorted(t for s, t in rollouts.temperatures if s == 0) == [1.0, 1.0, 1.5, 1.5]
    assert {t for s, t in rollouts.temperatures if s != 0} == {1.0}  # only the failed group is retried
    assert [(s.groups_retried, s.groups_rescued) for s in result.steps] == [(1, 1), (0, 0)]
    # the step's rewards and metrics are the first rollouts' (0, 0 | 1, 0), not the retry's
    assert result.steps[0].trajectories == 4 and result.steps[0].reward_mean == pytest.approx(0.25)
    assert result.steps[0].metrics["hot"] == pytest.approx(1.0)


def test_a_retry_in_which_nothing_passes_is_dropped_after_its_attempts() -> None:
    server = RecordingServer()
    rollouts = SureAndWrong(stuck={0}, passing=0)  # never passes, however hot
    result = make(server, rollouts, range(100), max_steps_off_policy=0,  # type: ignore[arg-type]
                  retry_failed=art.RetryFailedGroups(temperature=2.0, attempts=3, group_size=4)).run_sync(num_steps=1)
    trained = {int(g.trajectories[0].messages()[0]["content"]): g for batch in server.trained_batches for g in batch}
    assert [t.reward for t in trained[0].trajectories] == [0.0, 0.0]  # trained as it was (no signal)
    assert sorted(t for s, t in rollouts.temperatures if s == 0) == [1.0] * 2 + [2.0] * 12  # 3 retries of 4
    assert (result.steps[0].groups_retried, result.steps[0].groups_rescued) == (1, 0)


def test_a_rescued_group_needs_no_guide_and_a_retry_needs_a_pass_threshold() -> None:
    server = RecordingServer()
    asked: list[int] = []

    def guide(scenario: int) -> art.Trajectory:
        asked.append(scenario)
        return reference(scenario)

    result = make(server, SureAndWrong(stuck={0, 1}, passing=0), range(2), max_steps_off_policy=0,  # type: ignore[arg-type]
                  retry_failed=art.RetryFailedGroups(), guide=guide).run_sync(num_steps=1)
    assert sorted(asked) == [0, 1] and result.steps[0].groups_guided == 2  # the retries found nothing
    asked.clear()
    make(RecordingServer(), SureAndWrong(stuck={0, 1}), range(2), max_steps_off_policy=0,  # type: ignore[arg-type]
         retry_failed=art.RetryFailedGroups(), guide=guide).run_sync(num_steps=1)
    assert asked == []  # both rescued by their retries
    with pytest.raises(ValueError, match="retry_failed needs a group objective"):
        make(server, SureAndWrong(stuck=set()), range(5), retry_failed=art.RetryFailedGroups(),  # type: ignore[arg-type]
             objective="sft")
    with pytest.raises(ValidationError):
        art.RetryFailedGroups(temperature=0.0)


def test_bad_remedy_options_fail_before_anything_runs() -> None:
    server = RecordingServer()
    rollouts = ScriptedRollouts()
    with pytest.raises(TypeError, match="sequence"):
        make(server, rollouts, iter(range(5)), curriculum=art.PassRateCurriculum())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="curriculum"):
        make(server, rollouts, range(5), scenario_key=str)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="temperature"):
        make(server, rollouts, range(5), temperature=art.Schedule(start=1.0, end=0.0, steps=3))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="group_size"):
        make(server, rollouts, range(5), group_size_schedule=art.Schedule(start=0, end=4, steps=3))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pass_threshold"):
        make(server, rollouts, range(5), guide=reference, objective="sft")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------ entropy bonus


def test_the_grpo_family_takes_an_entropy_bonus() -> None:
    for config in (GRPOConfig, CISPOConfig, ImportanceSamplingConfig):
        assert not build_objective(config()).entropy_gradient
        assert build_objective(config(entropy_coef=0.01)).entropy_gradient
    assert "entropy_coef" not in GSPOConfig.model_fields  # a sequence-level objective: not offered
    with pytest.raises(ValidationError):
        train_config(entropy_coef=-0.1)


def test_the_entropy_bonus_subtracts_the_aggregated_entropy_and_pushes_it_up() -> None:
    logprobs = torch.tensor([[-1.0, -1.0, 0.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True, True, False]])
    entropy = torch.tensor([[0.5, 1.5, 9.0]], dtype=torch.float64, requires_grad=True)  # masked 9.0 ignored
    batch = PolicyBatch(logprobs, mask, logprobs.detach().clone(), torch.tensor([1.0], dtype=torch.float64),
                        entropy=entropy)
    base = build_objective(GRPOConfig()).loss(batch, 2.0)
    out = build_objective(GRPOConfig(entropy_coef=0.1)).loss(batch, 2.0)
    # −0.1 · (0.5 + 1.5) / 2 = −0.1
    assert float(out.loss.detach() - base.loss.detach()) == pytest.approx(-0.1, abs=1e-12)
    assert float(out.policy_loss) == pytest.approx(float(base.policy_loss), abs=1e-12)  # reported apart
    out.loss.backward()
    assert entropy.grad is not None and entropy.grad.tolist()[0] == pytest.approx([-0.05, -0.05, 0.0])
    sequence = build_objective(train_config(objective="cispo", entropy_coef=0.2, loss_aggregation="sequence"))
    # "sequence": the one sequence's mean entropy 1.0, over 1 sequence: −0.2
    assert float(sequence.loss(batch, 1.0).loss.detach() - build_objective(CISPOConfig(
        loss_aggregation="sequence")).loss(batch, 1.0).loss.detach()) == pytest.approx(-0.2, abs=1e-12)


# --------------------------------------------------------------------------------------- entropy control


def test_the_entropy_control_moves_the_bonus_towards_its_target_within_bounds() -> None:
    control = art.EntropyControl(target=0.2, coef_step=0.01, max_coef=0.025)
    coef, trace = 0.0, []
    for entropy in (0.8, 0.1, 0.1, 0.1, None, 0.3, 0.3, 0.3, 0.3):
        coef = control.next_coef(coef, entropy)
        trace.append(coef)
    # over the target: stays at 0; under: +0.01 a step up to 0.025; unmeasured: kept; over: −0.01 down to 0
    assert trace == pytest.approx([0.0, 0.01, 0.02, 0.025, 0.025, 0.015, 0.005, 0.0, 0.0])
    for bad in ({"target": 0.0}, {"target": 0.2, "coef_step": 0.0}, {"target": 0.2, "max_coef": -1.0}):
        with pytest.raises(ValidationError):
            art.EntropyControl(**bad)


@dataclass
class SharpeningServer(RecordingServer):
    """Reports the sampling entropy of each train call from `entropies` (None: the call finds no signal)."""

    entropies: list[float | None] = field(default_factory=list)

    async def _train(self, groups: list[art.TrajectoryGroup]) -> art.TrainResult:
        entropy = self.entropies[len(self.trained_batches)]
        if entropy is None:
            self.no_signal_calls.add(len(self.trained_batches))
        result = await super()._train(groups)
        if result.start is None:
            return result
        return result.model_copy(update={"start": result.start.model_copy(update={"sampling_entropy": entropy})})


def test_the_pipeline_trains_each_step_with_the_controlled_entropy_bonus_and_resumes_it(tmp_path: Any) -> None:
    state = tmp_path / "pipeline.json"
    control = art.EntropyControl(target=0.2, coef_step=0.01, max_coef=0.025)
    server = SharpeningServer(entropies=[0.8, 0.1, None, 0.1, 0.1, 0.3, 0.3])
    result = make(server, ScriptedRollouts(), range(100), max_steps_off_policy=0,  # type: ignore[arg-type]
                  entropy_control=control, entropy_coef=0.005, state_path=state).run_sync(num_steps=4)
    # starts at the config's 0.005; 0.8 is over the target (down), 0.1 under (up), a step without signal keeps it
    assert [c.entropy_coef for c in server.configs] == pytest.approx([0.005, 0.0, 0.01, 0.01])
    assert [s.entropy_coef for s in result.steps] == pytest.approx([0.005, 0.0, 0.01, 0.01])
    resumed = make(server, ScriptedRollouts(), range(100), max_steps_off_policy=0,  # type: ignore[arg-type]
                   entropy_control=control, entropy_coef=0.005, state_path=state).run_sync(num_steps=7)
    assert [c.entropy_coef for c in server.configs[4:]] == pytest.approx([0.02, 0.025, 0.015])
    assert [s.entropy_coef for s in resumed.steps] == pytest.approx([0.005, 0.0, 0.01, 0.01, 0.02, 0.025, 0.015])


def test_without_a_control_the_bonus_is_the_configs_and_an_objective_without_one_is_refused() -> None:
    server = RecordingServer()
    result = make(server, ScriptedRollouts(), range(100), entropy_coef=0.003).run_sync(num_steps=2)  # type: ignore[arg-type]
    assert [c.entropy_coef for c in server.configs] == [0.003, 0.003]
    assert [s.entropy_coef for s in result.steps] == [0.003, 0.003]
    with pytest.raises(ValueError, match="entropy_control needs an objective with an entropy bonus"):
        make(server, ScriptedRollouts(), range(5), objective="gspo",  # type: ignore[arg-type]
             entropy_control=art.EntropyControl(target=0.2))
