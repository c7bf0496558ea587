"""`PipelineTrainer`: RL that keeps sampling while it trains, with bounded staleness.

A sequential loop (rollouts, then train, then rollouts...) leaves the engine idle while the trainer works and
the trainer idle while the rollouts run. The pipeline keeps up to `(1 + max_steps_off_policy) × groups_per_step`
groups of rollouts going; it trains as soon as `groups_per_step` groups are finished while the next groups
keep sampling from the served step (the alias `name`, which every new rollout calls):

    max_steps_off_policy=1, groups_per_step=G (each box: G groups of rollouts; k→k+1: a training step)
      engine   [batch 0, batch 1 ...........][batch 2 ........][batch 3 ........]
      trainer                  [train 0→1 ]  [train 1→2 ]      [train 2→3 ]
    max_steps_off_policy=0 is the sequential loop.

Off-policy data is what the importance ratio ρ = π_θ / π_behaviour (on the behaviour logprobs the server
recorded at sampling time) corrects, and the bound keeps it small: a group sampled more than
`max_steps_off_policy` steps before the step it would train from is dropped (`stale="drop"`, the default) or
trained anyway (`stale="train"`: the ratio's clipping bounds its update). Each trajectory's
`metadata["policy_step"]` is the step served when its rollout began; its staleness is counted from there (a
multi-turn rollout that spans a swap also saw a newer step, so the count is an upper bound).

A step without signal (every group's rewards equal) trains nothing and the loop goes on (`trained=False`).
Evaluation (`evaluate`, every `eval_every` steps, before the first step and after the last) is recorded on
the server (`POST .../evaluations`), tracks the best step, and with `keep_last` sets a retention that keeps
the best evaluated step and the newest ones. With `state_path` the loop's own state (steps done, which
scenarios were used, the best step, the step reports) is written after every step, so a crashed run resumes
where it stopped: `run(num_steps)` counts steps over all runs.

Against a flattening curve (`_remedies.py`): `dynamic_sampling` drops groups without reward variance and
waits for more (bounded); `curriculum` draws scenarios from the pool by their recent pass rate (preferring
those strictly between 0 and 1); `temperature`, `group_size_schedule` and `learning_rate_schedule` vary the
sampling temperature (read in the rollout with `art.rollout_temperature()`), the group size and the step's
learning rate over the run's steps; `entropy_control` moves the entropy bonus after each step towards a
target sampling entropy.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import statistics
import time
import warnings
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from inspect import isawaitable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

from pydantic import BaseModel, Field
from tqdm.auto import tqdm

from ._gather import exception_budget
from ._remedies import (
    CurriculumSampler,
    DynamicSampling,
    EntropyControl,
    PassRateCurriculum,
    RetryFailedGroups,
    Schedule,
    has_signal,
    set_rollout_temperature,
)
from ._tasks import bounded
from ._train import NoSignalWarning, TrainResult
from ._trajectory import Trajectory, TrajectoryGroup
from .types import KeepBest, StepRetention, TrainConfig, train_config

if TYPE_CHECKING:
    from ._model import TrainableModel

__all__ = ["PipelineResult", "PipelineStep", "PipelineTrainer"]

logger = logging.getLogger("artlike")

Scenario = TypeVar("Scenario")
STATE_VERSION = 1


class PipelineStep(BaseModel):
    """What one step of the pipeline did: its data, its staleness and where the time went."""

    index: int  # 1-based count of pipeline steps (over resumed runs too)
    from_step: int  # the served step it trained from
    step: int  # the served step after it (== from_step when nothing was trained)
    trained: bool
    reason: str | None = None  # why nothing was trained
    groups: int
    trajectories: int
    reward_mean: float
    reward_std: float
    metrics: dict[str, float] = Field(default_factory=dict)  # mean of each trajectory metric
    staleness_mean: float  # steps between sampling and training, over the step's groups
    staleness_max: int
    groups_dropped_stale: int  # since the previous step: sampled more than max_steps_off_policy steps before
    groups_dropped_failed: int  # since the previous step: fewer than min_group_size rollouts finished, or scored None
    groups_guided: int = 0  # groups whose rollouts all failed and that trained with the guide's reference added
    groups_retried: int = 0  # since the previous step: groups whose rollouts all failed, rolled out again hotter
    groups_rescued: int = 0  # groups that trained with a hotter retry joined (one of its rollouts passed)
    zero_variance_groups: int  # groups whose rewards were all equal (no signal)
    logprob_mismatch: float | None = None  # mean |logπθ − logπ_behaviour| reported by the server
    clip_fraction: float | None = None  # trained tokens whose update the objective's clip limited
    loss: float | None = None
    objective_metrics: dict[str, float] = Field(default_factory=dict)  # the objective's own (StepEvent.metrics), mean
    # Why learning slows, as the train call reported it (None where it did not: see `StartEvent`/`StepEvent`).
    # A step refused for lack of signal has no report; its pass distribution is counted from its rewards.
    zero_variance_fraction: float | None = None  # zero_variance_groups / groups
    groups_all_wrong: int | None = None  # by the config's pass_threshold
    groups_mixed: int | None = None
    groups_all_right: int | None = None
    pass_rate: float | None = None  # fraction of the step's trajectories that passed
    response_tokens_mean: float | None = None  # completion tokens per trajectory
    sampling_entropy: float | None = None  # mean −logprob of the sampled tokens (the sampling policy's entropy)
    entropy: float | None = None  # the trained policy's mean token entropy over the step's gradient steps
    entropy_coef: float | None = None  # the entropy bonus the step trained with (`entropy_control` moves it)
    kl_to_base: float | None = None  # mean k3 KL to the base model over the gradient steps, when measured
    rollout_seconds: float  # from the first rollout start to the last rollout end of the step's groups
    wait_seconds: float  # the trainer waited this long for the step's groups
    train_seconds: float
    step_seconds: float  # wall time since the previous step ended
    eval: dict[str, float] | None = None  # the evaluation after this step, when one ran
    best_step: int | None = None


class PipelineResult(BaseModel):
    steps: list[PipelineStep]
    final_step: int
    best_step: int | None  # by `eval_metric`, None without evaluation
    best_value: float | None
    evaluations: dict[int, dict[str, float]]  # served step → evaluation
    wall_seconds: float
    engine_busy_fraction: float  # share of the run with at least one rollout in flight
    trainer_busy_fraction: float  # share of the run with a training step in flight
    stopped: Literal["num_steps", "max_seconds", "scenarios_exhausted"]


@dataclass
class _FinishedGroup:
    index: int  # the scenario's position in the scenario iterator
    group: TrajectoryGroup
    policy_step: int
    started: float
    finished: float


@dataclass
class _Activity:
    """Busy time of one side (engine or trainer): time during which at least one unit of work was running."""

    active: int = 0
    since: float = 0.0
    busy: float = 0.0

    def enter(self) -> None:
        if self.active == 0:
            self.since = time.perf_counter()
        self.active += 1

    def exit(self) -> None:
        self.active -= 1
        if self.active == 0:
            self.busy += time.perf_counter() - self.since

    def total(self) -> float:
        return self.busy + (time.perf_counter() - self.since if self.active else 0.0)


@dataclass
class _State:
    """The loop's own state, saved after every step (`state_path`) so a crashed run resumes."""

    model: str
    steps_done: int = 0
    served_step: int = 0
    cursor: int = 0  # every scenario before it is used
    used_above: set[int] = field(default_factory=set)  # used scenarios at or after the cursor
    best_step: int | None = None
    best_value: float | None = None
    evaluations: dict[int, dict[str, float]] = field(default_factory=dict)
    reports: list[PipelineStep] = field(default_factory=list)

    def mark_used(self, index: int) -> None:
        self.used_above.add(index)
        while self.cursor in self.used_above:
            self.used_above.discard(self.cursor)
            self.cursor += 1

    def used(self, index: int) -> bool:
        return index < self.cursor or index in self.used_above

    def dump(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "model": self.model, "steps_done": self.steps_done,
                "served_step": self.served_step, "cursor": self.cursor, "used_above": sorted(self.used_above),
                "best_step": self.best_step, "best_value": self.best_value,
                "evaluations": {str(k): v for k, v in self.evaluations.items()},
                "reports": [report.model_dump(mode="json") for report in self.reports]}

    @classmethod
    def load(cls, data: Mapping[str, Any]) -> _State:
        if data.get("version") != STATE_VERSION:
            raise ValueError(f"pipeline state version {data.get('version')!r} is not {STATE_VERSION}")
        return cls(model=data["model"], steps_done=data["steps_done"], served_step=data["served_step"],
                   cursor=data["cursor"], used_above=set(data["used_above"]), best_step=data["best_step"],
                   best_value=data["best_value"],
                   evaluations={int(k): dict(v) for k, v in data["evaluations"].items()},
                   reports=[PipelineStep.model_validate(r) for r in data["reports"]])


def _write_atomically(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(data, indent=1))
    os.replace(temporary, path)


def staleness(trained_from: int, policy_steps: Iterable[int]) -> int:
    """How many steps behind the policy that trains a group is the oldest step that sampled it.

    >>> staleness(5, [4, 5, 4]), staleness(5, [5, 5])
    (1, 0)
    """
    return max(0, trained_from - min(policy_steps))


GUIDE_METADATA = "guide"  # a trajectory's metadata key: the guide's reference, not a rollout
RETRY_METADATA = "retry_temperature"  # a trajectory's metadata key: a hotter retry's rollout, at this temperature


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0


@dataclass(frozen=True)
class PassDistribution:
    all_wrong: int
    mixed: int
    all_right: int
    pass_rate: float | None


def pass_distribution(rewards_by_group: Sequence[Sequence[float]], pass_threshold: float) -> PassDistribution:
    """The groups' pass distribution where the server reported none: a step it refused for lack of signal
    (every group's rewards equal) still says whether its groups were all wrong or all right.

    >>> pass_distribution([[1.0, 1.0], [0.1, 0.1], [1.0, 0.0]], pass_threshold=0.5)
    PassDistribution(all_wrong=1, mixed=1, all_right=1, pass_rate=0.5)
    """
    passing = [sum(r >= pass_threshold for r in rewards) for rewards in rewards_by_group if rewards]
    sizes = [len(rewards) for rewards in rewards_by_group if rewards]
    all_wrong = sum(p == 0 for p in passing)
    all_right = sum(p == n for p, n in zip(passing, sizes, strict=True))
    return PassDistribution(all_wrong=all_wrong, mixed=len(passing) - all_wrong - all_right, all_right=all_right,
                            pass_rate=sum(passing) / sum(sizes) if sizes else None)


class PipelineTrainer(Generic[Scenario]):
    """Train `model` on rollouts of `scenarios`, sampling the next steps' groups while a step trains.

        async def rollout(scenario) -> art.Trajectory:
            async with model.trajectory() as t:
                ...                                   # any OpenAI client on t.base_url, model=t.model
                t.reward = score(...)
            return t

        trainer = art.PipelineTrainer(model, rollout, scenarios, group_size=8, groups_per_step=8,
                                      max_steps_off_policy=1, learning_rate=5e-5)
        result = await trainer.run(num_steps=20)       # or trainer.run_sync(num_steps=20)

    `rollout(scenario)` makes one trajectory; `group_size` of them form a group. `score_group` (optional, async)
    rewrites a finished group (e.g. `lambda g: art.judge_group(g, judge=...)`) or returns None to drop it.
    `evaluate(step)` (optional, async) returns held-out metrics of the served step; `eval_metric` (in them)
    picks the best step. Training options are `model.train`'s (`config=` or `**train_options`).
    `rollout_concurrency` caps the trajectories in flight (None: all of the allowed groups');
    `max_exceptions` is the failed-rollout budget over the run (a count, or a fraction of the rollouts
    started; past it the failure is raised).

    Against a plateau (each off by default): `dynamic_sampling=art.DynamicSampling()` trains only groups
    with reward variance, sampling more (bounded) to fill a step; `curriculum=art.PassRateCurriculum()`
    draws from `scenarios` (then a sequence, the pool, drawn from again and again; `scenario_key` names a
    scenario, default its position) the ones whose recent pass rate is strictly between 0 and 1;
    `temperature`, `group_size_schedule` and `learning_rate_schedule` are `art.Schedule`s over the steps
    done (the rollout reads its temperature with `art.rollout_temperature()`; the learning rate replaces
    the config's for each step). `entropy_control=art.EntropyControl(target=...)` raises the entropy bonus
    after each step whose sampling entropy is under the target and lowers it when over (the step's
    `entropy_coef` says what it trained with). `guide(scenario)` (sync or async) returns a reference trajectory with its
    reward (e.g. the known answer as an offline `art.Trajectory`, or a stronger model's), or None: when no
    rollout of a group reaches the config's `pass_threshold`, the reference joins the group, so a problem
    the policy always fails still teaches (off-policy guidance, as in LUFFY). The step's `groups_guided`
    counts them; its rewards and metrics are the rollouts'. `retry_failed=art.RetryFailedGroups()` rolls
    such a group out again at a hotter temperature (the rollout reads it with `art.rollout_temperature()`),
    and a retry in which a rollout passes joins the group, with no reference needed; the step's
    `groups_retried` and `groups_rescued` count them, and its rewards and metrics are the first rollouts'.
    """

    def __init__(
        self,
        model: TrainableModel,
        rollout: Callable[[Scenario], Awaitable[Trajectory]],
        scenarios: Iterable[Scenario],
        *,
        group_size: int = 8,
        groups_per_step: int = 8,
        max_steps_off_policy: int = 1,
        stale: Literal["drop", "train"] = "drop",
        score_group: Callable[[TrajectoryGroup], Awaitable[TrajectoryGroup | None]] | None = None,
        min_group_size: int = 2,
        rollout_concurrency: int | None = None,
        max_exceptions: int | float = 0,
        evaluate: Callable[[int], Awaitable[Mapping[str, float]]] | None = None,
        eval_every: int = 0,
        eval_metric: str = "reward",
        eval_mode: Literal["max", "min"] = "max",
        keep_last: int | None = None,
        state_path: str | os.PathLike[str] | None = None,
        progress: bool = True,
        on_step: Callable[[PipelineStep], None] | None = None,
        config: TrainConfig | None = None,
        dynamic_sampling: DynamicSampling | None = None,
        curriculum: PassRateCurriculum | None = None,
        scenario_key: Callable[[Scenario], Hashable] | None = None,
        temperature: Schedule | None = None,
        group_size_schedule: Schedule | None = None,
        learning_rate_schedule: Schedule | None = None,
        entropy_control: EntropyControl | None = None,
        guide: Callable[[Scenario], Trajectory | Awaitable[Trajectory | None] | None] | None = None,
        retry_failed: RetryFailedGroups | None = None,
        **train_options: Any,
    ) -> None:
        for name, value, low in (("group_size", group_size, 1), ("groups_per_step", groups_per_step, 1),
                                 ("max_steps_off_policy", max_steps_off_policy, 0), ("eval_every", eval_every, 0),
                                 ("min_group_size", min_group_size, 1)):
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        if rollout_concurrency is not None and rollout_concurrency < 1:
            raise ValueError(f"rollout_concurrency must be >= 1 or None, got {rollout_concurrency}")
        if stale not in ("drop", "train"):
            raise ValueError(f"stale must be 'drop' or 'train', not {stale!r}")
        if eval_every and evaluate is None:
            raise ValueError("eval_every needs an evaluate function")
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        if config is not None and train_options:
            raise TypeError("pass either config= or training options as keywords, not both")
        if curriculum is not None and not isinstance(scenarios, Sequence):
            raise TypeError("a curriculum draws from a pool: pass the scenarios as a sequence (e.g. a list)")
        if scenario_key is not None and curriculum is None:
            raise ValueError("scenario_key names scenarios for a curriculum; pass curriculum= too")
        for name, schedule in (("temperature", temperature), ("learning_rate_schedule", learning_rate_schedule)):
            if schedule is not None and min(schedule.start, schedule.end) <= 0:
                raise ValueError(f"{name} must stay > 0, got start={schedule.start}, end={schedule.end}")
        if group_size_schedule is not None and min(group_size_schedule.start, group_size_schedule.end) < 1:
            raise ValueError("group_size_schedule must stay >= 1")
        self.model = model
        self.rollout = rollout
        self.scenarios = scenarios
        self.group_size, self.groups_per_step = group_size, groups_per_step
        self.max_steps_off_policy, self.stale = max_steps_off_policy, stale
        self.score_group, self.min_group_size = score_group, min_group_size
        self.rollout_concurrency, self.max_exceptions = rollout_concurrency, max_exceptions
        self.evaluate, self.eval_every = evaluate, eval_every
        self.eval_metric, self.eval_mode = eval_metric, eval_mode
        self.keep_last = keep_last
        self.state_path = Path(state_path) if state_path is not None else None
        self.progress, self.on_step = progress, on_step
        self.config = config if config is not None else train_config(**train_options)  # validated now
        self.dynamic_sampling, self.curriculum, self.scenario_key = dynamic_sampling, curriculum, scenario_key
        self.temperature, self.group_size_schedule = temperature, group_size_schedule
        self.learning_rate_schedule, self.entropy_control = learning_rate_schedule, entropy_control
        if entropy_control is not None and not hasattr(self.config, "entropy_coef"):
            raise ValueError(f"entropy_control needs an objective with an entropy bonus (grpo, cispo, "
                             f"importance_sampling), not {self.config.objective!r}")
        self.guide, self.retry_failed = guide, retry_failed
        # A rollout passes when its reward reaches the config's pass_threshold (the group objectives have one).
        self.pass_threshold: float | None = getattr(self.config, "pass_threshold", None)
        for name, option in (("a guide", guide), ("retry_failed", retry_failed)):
            if option is not None and self.pass_threshold is None:
                raise ValueError(f"{name} needs a group objective with a pass_threshold, "
                                 f"not {self.config.objective!r}")
        self._sampler: CurriculumSampler | None = None  # built on the first run, kept over the next ones

    def curriculum_sampler(self) -> CurriculumSampler | None:
        """The curriculum's sampler (its pass rates), shared by every `run` of this trainer; None without one."""
        if self.curriculum is None:
            return None
        if self._sampler is None:
            pool = self.scenarios
            assert isinstance(pool, Sequence)
            key = self.scenario_key
            self._sampler = CurriculumSampler([key(s) for s in pool] if key else list(range(len(pool))),
                                              self.curriculum)
        return self._sampler

    # ------------------------------------------------------------------------------------ public

    async def run(self, num_steps: int | None = None, *, max_seconds: float | None = None) -> PipelineResult:
        """Run until `num_steps` steps are done (counted over resumed runs), `max_seconds` have passed (the step
        in progress finishes), or the scenarios run out (a last partial batch still trains)."""
        return await _Run(self, num_steps, max_seconds).execute()

    def run_sync(self, num_steps: int | None = None, *, max_seconds: float | None = None) -> PipelineResult:
        """`run` for sync code (starts its own event loop)."""
        return asyncio.run(self.run(num_steps, max_seconds=max_seconds))

    # ------------------------------------------------------------------------------------ helpers

    def _retention(self) -> StepRetention | None:
        if self.keep_last is None:
            return None
        best = KeepBest(metric=f"eval.{self.eval_metric}", mode=self.eval_mode) if self.evaluate else None
        return StepRetention(keep_last=self.keep_last, keep_best=best)

    def _better(self, value: float, best: float | None) -> bool:
        return best is None or (value > best if self.eval_mode == "max" else value < best)


class _Run(Generic[Scenario]):
    """One `PipelineTrainer.run`: the producer (rollout groups) and the consumer (training steps)."""

    def __init__(self, trainer: PipelineTrainer[Scenario], num_steps: int | None, max_seconds: float | None) -> None:
        self.t = trainer
        self.num_steps, self.max_seconds = num_steps, max_seconds
        self.capacity = (1 + trainer.max_steps_off_policy) * trainer.groups_per_step
        self.ready: deque[_FinishedGroup] = deque()
        self.outstanding = 0  # groups launched and not yet consumed by a finished step (or dropped)
        self.useful = 0  # groups launched and not dropped: no more are launched than the steps left can train
        self.out_of_time = False
        self.in_flight = 0  # group tasks running
        self.exhausted = False
        self.stopping = False
        self.changed = asyncio.Condition()
        self.failure: BaseException | None = None
        self.trained_groups = 0  # groups consumed by this run's steps
        self.rollouts_started = 0
        self.rollouts_failed = 0
        self.dropped_stale = 0
        self.dropped_failed = 0
        self.dropped_zero_variance = 0  # since the previous step: without reward variance (dynamic sampling)
        self.retried = 0  # since the previous step: all-failed groups rolled out again hotter
        self.sampler = trainer.curriculum_sampler()
        self.engine, self.trainer = _Activity(), _Activity()
        self.limit = asyncio.Semaphore(trainer.rollout_concurrency) if trainer.rollout_concurrency else None
        self.tasks: set[asyncio.Task[None]] = set()
        self.state = _State(model=trainer.model.name)

    # ----------------------------------------------------------------------------- orchestration

    async def execute(self) -> PipelineResult:
        started = time.perf_counter()
        self.deadline = started + self.max_seconds if self.max_seconds is not None else None
        await self._load_state()
        retention = self.t._retention()
        if retention is not None:
            await self.t.model.set_retention(retention)
        bar = tqdm(total=self.num_steps, initial=min(self.state.steps_done, self.num_steps or self.state.steps_done),
                   desc=f"pipeline {self.t.model.name}", unit="step", disable=not self.t.progress)
        producer = asyncio.create_task(self._produce())
        stopped: Literal["num_steps", "max_seconds", "scenarios_exhausted"] = "scenarios_exhausted"
        try:
            if self.t.evaluate is not None and self.state.served_step not in self.state.evaluations:
                await self._evaluate(None)
            previous_end = time.perf_counter()
            while True:
                if self.num_steps is not None and self.state.steps_done >= self.num_steps:
                    stopped = "num_steps"
                    break
                if self.deadline is not None and time.perf_counter() >= self.deadline:
                    stopped = "max_seconds"
                    break
                waited_from = time.perf_counter()
                batch = await self._next_batch()
                if batch is None:
                    if self.out_of_time:
                        stopped = "max_seconds"
                    break
                report = await self._train(batch, waited=time.perf_counter() - waited_from,
                                           since_previous=previous_end)
                previous_end = time.perf_counter()
                bar.update(1)
                bar.set_postfix(reward=f"{report.reward_mean:.3f}", stale=f"{report.staleness_mean:.2f}",
                                rollout_s=f"{report.rollout_seconds:.1f}", train_s=f"{report.train_seconds:.1f}")
                if self.t.on_step is not None:
                    self.t.on_step(report)
            if self.t.evaluate is not None and self.state.served_step not in self.state.evaluations:
                await self._evaluate(self.state.reports[-1] if self.state.reports else None)
                self._save_state()
        finally:
            self.stopping = True
            producer.cancel()
            for task in self.tasks:
                task.cancel()
            await asyncio.gather(producer, *self.tasks, return_exceptions=True)
            bar.close()
        wall = time.perf_counter() - started
        return PipelineResult(
            steps=list(self.state.reports), final_step=self.state.served_step, best_step=self.state.best_step,
            best_value=self.state.best_value, evaluations=dict(self.state.evaluations), wall_seconds=wall,
            engine_busy_fraction=self.engine.total() / wall if wall else 0.0,
            trainer_busy_fraction=self.trainer.total() / wall if wall else 0.0, stopped=stopped)

    async def _load_state(self) -> None:
        served = await self.t.model.get_step()
        path = self.t.state_path
        if path is not None and path.exists():
            state = _State.load(json.loads(path.read_text()))
            if state.model != self.t.model.name:
                raise ValueError(f"{path} holds the pipeline state of model {state.model!r}, not "
                                 f"{self.t.model.name!r}")
            if served != state.served_step:
                logger.warning("artlike: resuming: the server serves step %d of %r, the saved state says %d; "
                               "going on from the served step", served, state.model, state.served_step)
            self.state = state
            logger.info("artlike: resumed the pipeline of %r after %d steps", state.model, state.steps_done)
        self.state.served_step = served

    def _save_state(self) -> None:
        if self.t.state_path is not None:
            _write_atomically(self.t.state_path, self.state.dump())

    # ---------------------------------------------------------------------------------- producer

    async def _produce(self) -> None:
        iterator: Iterator[Scenario] = iter(self.t.scenarios)
        index = -1
        while True:
            async with self.changed:
                await self.changed.wait_for(lambda: self.stopping or (self.outstanding < self.capacity
                                                                      and self.useful < self._groups_needed()))
                if self.stopping or (self.deadline is not None and time.perf_counter() >= self.deadline):
                    return
                if self.sampler is not None:  # a pool: drawn again and again, never exhausted
                    assert isinstance(self.t.scenarios, Sequence)
                    index = self.sampler.draw()
                    scenario = self.t.scenarios[index]
                while self.sampler is None:
                    try:
                        scenario = next(iterator)
                    except StopIteration:
                        self.exhausted = True
                        self.changed.notify_all()
                        return
                    index += 1
                    if not self.state.used(index):
                        break
                self.outstanding += 1
                self.useful += 1
                self.in_flight += 1
            task = asyncio.create_task(self._rollout_group(index, scenario))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    def _groups_needed(self) -> float:
        """Groups this run can still train, counted from its start (unbounded without num_steps)."""
        if self.num_steps is None:
            return float("inf")
        return self.trained_groups + (self.num_steps - self.state.steps_done) * self.t.groups_per_step

    async def _rollout_group(self, index: int, scenario: Scenario) -> None:
        policy_step, started = self.state.served_step, time.perf_counter()
        done = self.state.steps_done
        group_size = self.t.group_size_schedule.at_int(done) if self.t.group_size_schedule else self.t.group_size
        if self.t.temperature is not None:  # this task's context: its rollouts copy it
            set_rollout_temperature(self.t.temperature.at(done))
        try:
            outcomes = await self._rollouts(scenario, policy_step, group_size)
            finished = [o for o in outcomes if isinstance(o, Trajectory) and not o.failed]
            errors = [o if isinstance(o, Exception) else o.exception for o in outcomes
                      if not isinstance(o, Trajectory) or o.failed]
            group: TrajectoryGroup | None = TrajectoryGroup(finished, exceptions=[e for e in errors if e is not None])
            if group is not None and len(finished) >= self.t.min_group_size and self.t.score_group is not None:
                group = await self.t.score_group(group)
            usable = group is not None and len(group.trajectories) >= self.t.min_group_size
            trained = group
            if usable and group is not None:  # a hotter retry in which a rollout passed joins the group
                retry = await self._retry(scenario, group, policy_step, group_size)
                trained = TrajectoryGroup([*group.trajectories, *retry], exceptions=group.exceptions) if retry else group
            reference = await self._reference(scenario, trained) if usable and trained is not None else None
        except BaseException as error:
            async with self.changed:
                self.in_flight -= 1
                if not isinstance(error, asyncio.CancelledError):
                    self.failure = self.failure or error
                self.changed.notify_all()
            raise
        async with self.changed:
            self.in_flight -= 1
            if usable and group is not None and trained is not None:
                if self.sampler is not None:  # the pass rate of the policy's own rollouts
                    self.sampler.record(index, [t.reward for t in group.trajectories])
                if reference is not None:
                    trained = TrajectoryGroup([*trained.trajectories, reference], exceptions=trained.exceptions)
                self.ready.append(_FinishedGroup(index, trained, policy_step, started, time.perf_counter()))
            else:
                self.dropped_failed += 1
                self.outstanding -= 1
                self.useful -= 1
                self.state.mark_used(index)
            self.changed.notify_all()

    async def _rollouts(self, scenario: Scenario, policy_step: int, count: int) -> list[Trajectory | Exception]:
        """`count` rollouts of `scenario` at once, each a trajectory or the exception it failed with."""
        rollouts = [asyncio.ensure_future(self._rollout_one(scenario, policy_step)) for _ in range(count)]
        try:
            return await asyncio.gather(*rollouts)
        finally:  # one raised (past the failure budget) or this group was cancelled: stop its siblings
            for pending in rollouts:
                pending.cancel()

    async def _rollout_one(self, scenario: Scenario, policy_step: int) -> Trajectory | Exception:
        async with bounded(self.limit):
            self.engine.enter()
            self.rollouts_started += 1
            try:
                result = await self.t.rollout(scenario)
            except Exception as error:  # a failed rollout is an outcome, counted against the budget
                self._count_failure(error)
                return error
            finally:
                self.engine.exit()
        if not isinstance(result, Trajectory):
            raise TypeError(f"a rollout must return an artlike.Trajectory, got {type(result)!r}")
        result.metadata.setdefault("policy_step", policy_step)
        if result.failed:
            assert result.exception is not None
            self._count_failure(result.exception)
        return result

    def _none_passed(self, group: TrajectoryGroup) -> bool:
        threshold = self.t.pass_threshold
        return threshold is not None and not any(
            t.reward is not None and t.reward >= threshold for t in group.trajectories)

    async def _retry(self, scenario: Scenario, group: TrajectoryGroup, policy_step: int,
                     group_size: int) -> list[Trajectory]:
        """A hotter retry's rollouts for a group none of whose rollouts passed: the first retry in which one
        passes (marked with its temperature), else none."""
        retry = self.t.retry_failed
        if retry is None or not self._none_passed(group):
            return []
        self.retried += 1
        set_rollout_temperature(retry.temperature)  # this group's task only: its retries copy it
        for _ in range(retry.attempts):
            outcomes = await self._rollouts(scenario, policy_step, retry.group_size or group_size)
            again: TrajectoryGroup | None = TrajectoryGroup(
                [o for o in outcomes if isinstance(o, Trajectory) and not o.failed])
            if again is not None and self.t.score_group is not None and again.trajectories:
                again = await self.t.score_group(again)
            if again is not None and again.trajectories and not self._none_passed(again):
                for trajectory in again.trajectories:
                    trajectory.metadata[RETRY_METADATA] = retry.temperature
                return list(again.trajectories)
        return []

    async def _reference(self, scenario: Scenario, group: TrajectoryGroup) -> Trajectory | None:
        """The guide's reference for a group none of whose rollouts passed; None without a guide or a failure."""
        if self.t.guide is None or not self._none_passed(group):
            return None
        reference = self.t.guide(scenario)
        if isawaitable(reference):
            reference = await reference
        if reference is None:
            return None
        if not isinstance(reference, Trajectory) or reference.reward is None:
            raise TypeError(f"a guide returns an artlike.Trajectory with its reward, or None; got {reference!r}")
        reference.metadata[GUIDE_METADATA] = True
        return reference

    def _count_failure(self, error: Exception) -> None:
        self.rollouts_failed += 1
        budget = exception_budget(self.t.max_exceptions, max(self.rollouts_started, 1))
        if self.rollouts_failed > budget:
            error.add_note(f"artlike: {self.rollouts_failed} of {self.rollouts_started} rollouts failed, more than "
                           f"max_exceptions={self.t.max_exceptions!r} allows")
            raise error

    # ---------------------------------------------------------------------------------- consumer

    async def _next_batch(self) -> list[_FinishedGroup] | None:
        """The next step's groups (stale ones dropped), or None when no more will come."""
        batch: list[_FinishedGroup] = []
        dynamic = self.t.dynamic_sampling
        wanted = dynamic.signal_groups_wanted(self.t.groups_per_step) if dynamic else self.t.groups_per_step
        budget = dynamic.max_groups_examined(self.t.groups_per_step) if dynamic else 0
        examined = 0
        async with self.changed:
            while len(batch) < wanted:
                try:
                    async with asyncio.timeout_at(self._deadline_loop_time()):
                        await self.changed.wait_for(lambda: self.failure is not None or bool(self.ready)
                                                    or (self.exhausted and self.in_flight == 0))
                except TimeoutError:  # stop without training a partial batch
                    self.out_of_time = True
                    return None
                if self.failure is not None:
                    raise self.failure
                if not self.ready:
                    break  # the scenarios ran out: train what there is
                finished = self.ready.popleft()
                age = staleness(self.state.served_step, [finished.policy_step])
                if age > self.t.max_steps_off_policy and self.t.stale == "drop":
                    self.dropped_stale += 1
                    self._discard(finished)
                    continue
                examined += 1
                if dynamic is not None and not has_signal([t.reward for t in finished.group.trajectories]):
                    if examined < budget:  # no signal: sample another in its place
                        self.dropped_zero_variance += 1
                        self._discard(finished)
                        continue
                    batch.append(finished)  # past the bound: train what there is
                    break
                batch.append(finished)
        return batch or None

    def _discard(self, finished: _FinishedGroup) -> None:
        """A finished group that will not train: its scenario is used, and another group is sampled instead."""
        self.outstanding -= 1
        self.useful -= 1
        self.state.mark_used(finished.index)
        self.changed.notify_all()

    def _deadline_loop_time(self) -> float | None:
        if self.deadline is None:
            return None
        return asyncio.get_running_loop().time() + max(0.0, self.deadline - time.perf_counter())

    async def _train(self, batch: list[_FinishedGroup], *, waited: float, since_previous: float) -> PipelineStep:
        from_step = self.state.served_step
        groups = [finished.group for finished in batch]
        config = self._step_config()
        self.trainer.enter()
        started = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", NoSignalWarning)  # reported in the step's row instead
                result = await self.t.model.train(groups, config=config, progress=False)
        finally:
            self.trainer.exit()
        train_seconds = time.perf_counter() - started
        async with self.changed:
            self.state.served_step = result.step
            self.outstanding -= len(batch)
            self.trained_groups += len(batch)
            for finished in batch:
                self.state.mark_used(finished.index)
            self.changed.notify_all()
        self.state.steps_done += 1
        report = self._report(batch, result, config, from_step, waited, train_seconds, since_previous)
        self.dropped_stale = self.dropped_failed = self.dropped_zero_variance = self.retried = 0
        if not result.trained:
            logger.info("artlike: pipeline step %d trained nothing: %s", report.index, result.done.reason)
        if self.t.evaluate is not None and self.t.eval_every and self.state.steps_done % self.t.eval_every == 0:
            await self._evaluate(report)
        self.state.reports.append(report)
        self._save_state()
        return report

    def _step_config(self) -> TrainConfig:
        """The train config of the next step: the run's learning-rate schedule, when set, gives its rate, and
        the entropy control its entropy bonus."""
        update: dict[str, float] = {}
        schedule = self.t.learning_rate_schedule
        if schedule is not None:
            update["learning_rate"] = schedule.at(self.state.steps_done)
        if self.t.entropy_control is not None:
            update["entropy_coef"] = self._controlled_entropy_coef(self.t.entropy_control)
        return self.t.config.model_copy(update=update) if update else self.t.config

    def _controlled_entropy_coef(self, control: EntropyControl) -> float:
        """The entropy bonus of the next step: the config's at first, then moved by the entropy control after
        each step (read back from the step reports, so a resumed run goes on from where it stopped)."""
        last = self.state.reports[-1] if self.state.reports else None
        if last is None or last.entropy_coef is None:
            configured: float = getattr(self.t.config, "entropy_coef", 0.0)  # the constructor checked it has one
            return configured
        return control.next_coef(last.entropy_coef, last.sampling_entropy)

    def _report(self, batch: list[_FinishedGroup], result: TrainResult, config: TrainConfig, from_step: int,
                waited: float, train_seconds: float, since_previous: float) -> PipelineStep:
        trajectories = [t for finished in batch for t in finished.group.trajectories  # the first rollouts: a
                        if not t.metadata.get(GUIDE_METADATA) and RETRY_METADATA not in t.metadata]  # reference
        # is no sample, and a hotter retry's are not the step's policy at its temperature
        rewards = [t.reward for t in trajectories if t.reward is not None]
        ages = [staleness(from_step, [f.policy_step]) for f in batch]
        keys = sorted({key for t in trajectories for key in t.metrics})
        metrics = {key: _mean([t.metrics[key] for t in trajectories if key in t.metrics]) for key in keys}
        zero_variance = self.dropped_zero_variance + (
            result.start.groups_skipped if result.start is not None else
            sum(len({t.reward for t in f.group.trajectories}) <= 1 for f in batch))
        steps = result.metrics
        start = result.start
        threshold = self.t.pass_threshold
        local = None if start is not None or threshold is None else pass_distribution(
            [[t.reward for t in f.group.trajectories if t.reward is not None] for f in batch], threshold)
        kl_to_base = [s.kl_to_base for s in steps if s.kl_to_base is not None]
        return PipelineStep(
            index=self.state.steps_done, from_step=from_step, step=result.step, trained=result.trained,
            reason=result.done.reason, groups=len(batch), trajectories=len(trajectories),
            reward_mean=_mean(rewards), reward_std=statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
            metrics=metrics, staleness_mean=_mean([float(a) for a in ages]), staleness_max=max(ages, default=0),
            groups_dropped_stale=self.dropped_stale, groups_dropped_failed=self.dropped_failed,
            groups_guided=sum(any(t.metadata.get(GUIDE_METADATA) for t in f.group.trajectories) for f in batch),
            groups_retried=self.retried,
            groups_rescued=sum(any(RETRY_METADATA in t.metadata for t in f.group.trajectories) for f in batch),
            zero_variance_groups=zero_variance,
            logprob_mismatch=_mean([s.logprob_mismatch for s in steps]) if steps else None,
            clip_fraction=_mean([s.clip_fraction for s in steps]) if steps else None,
            loss=_mean([s.loss for s in steps]) if steps else None,
            objective_metrics=result.objective_metrics,
            zero_variance_fraction=(start.zero_variance_fraction if start is not None
                                    else zero_variance / len(batch) if batch else None),
            groups_all_wrong=start.groups_all_wrong if start else local.all_wrong if local else None,
            groups_mixed=start.groups_mixed if start else local.mixed if local else None,
            groups_all_right=start.groups_all_right if start else local.all_right if local else None,
            pass_rate=start.pass_rate if start else local.pass_rate if local else None,
            response_tokens_mean=start.response_tokens_mean if start else None,
            sampling_entropy=start.sampling_entropy if start else None,
            entropy=_mean([s.entropy for s in steps]) if steps else None,
            entropy_coef=getattr(config, "entropy_coef", None),
            kl_to_base=_mean(kl_to_base) if kl_to_base else None,
            rollout_seconds=max(f.finished for f in batch) - min(f.started for f in batch),
            wait_seconds=waited, train_seconds=train_seconds, step_seconds=time.perf_counter() - since_previous,
            best_step=self.state.best_step)

    async def _evaluate(self, report: PipelineStep | None) -> None:
        assert self.t.evaluate is not None
        step = self.state.served_step
        metrics = {key: float(value) for key, value in (await self.t.evaluate(step)).items()}
        if self.t.eval_metric not in metrics:
            raise KeyError(f"evaluate() returned {sorted(metrics)}, without eval_metric {self.t.eval_metric!r}")
        self.state.evaluations[step] = metrics
        if self.t._better(metrics[self.t.eval_metric], self.state.best_value):
            self.state.best_step, self.state.best_value = step, metrics[self.t.eval_metric]
        await self.t.model.log_evaluation(step, metrics)
        if report is not None:
            report.eval, report.best_step = metrics, self.state.best_step
        logger.info("artlike: evaluation of step %d: %s", step, metrics)

