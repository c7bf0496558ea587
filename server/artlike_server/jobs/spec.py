"""What a managed job is asked to do, in one validated object that the store keeps and the runner reads.

Both front doors (OpenAI's fine-tuning jobs API and MotteRL's `/api/training/start`) translate their
request into a `JobSpec`; the runner never sees either wire format. Defaults are ours, for a LoRA GRPO run
on a small model: MotteRL's learning-rate default (0.01) would wreck a LoRA, so a request that sends such a
value is accepted and warned about (`learning_rate_warning`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from artlike import DynamicSampling, EntropyControl, Schedule

DEFAULT_LEARNING_RATE = 1e-5
DEFAULT_GROUP_SIZE = 8
DEFAULT_BATCH_SIZE = 8
LEARNING_RATES_SEEN_WORKING = (1e-7, 1e-3)
"""LoRA GRPO learning rates we have seen train without diverging; outside it the job warns, not refuses."""

JobStatus = Literal["validating_files", "queued", "running", "paused", "succeeded", "failed", "cancelled"]
FINISHED: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class PythonReward(_Frozen):
    """User code, run only in the sandbox. `entry` is the function that scores: OpenAI's `grade(sample, item)`,
    or MotteRL's `reward_fn(completion, **kwargs)` (any name, when the module defines one function)."""

    kind: Literal["python"] = "python"
    source: str
    entry: str
    functions: tuple[str, ...] = ()  # every top-level function: next_turn and tool functions live here too
    pass_threshold: float | None = None


class GraderReward(_Frozen):
    """A grader config for `artlike.graders` (OpenAI's JSON or SeekrFlow's RewardComponents); python
    graders nested in it run in the sandbox."""

    kind: Literal["grader"] = "grader"
    grader: dict[str, Any]
    source: str | None = None  # a module with next_turn / tool functions, when the request gave one
    functions: tuple[str, ...] = ()
    pass_threshold: float | None = None


Reward = Annotated[PythonReward | GraderReward, Field(discriminator="kind")]


class RolloutSettings(_Frozen):
    group_size: int = Field(DEFAULT_GROUP_SIZE, ge=2, le=64)
    max_tokens: int = Field(256, ge=1, le=32_768)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    max_turns: int = Field(1, ge=1, le=64)
    multi_step: bool = False  # the reward module's next_turn(messages, **kwargs) gives the next user message


class EvalSettings(_Frozen):
    interval: int | None = Field(None, ge=1)  # every N iterations (and before the first and after the last)
    samples: int = Field(1, ge=1, le=16)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    pass_threshold: float = 0.5  # a sample passes when its reward >= this


def _within(schedule: Schedule | None, low: float, high: float) -> Schedule | None:
    if schedule is not None and not (low <= min(schedule.start, schedule.end)
                                     and max(schedule.start, schedule.end) <= high):
        raise ValueError(f"the schedule must stay within [{low:g}, {high:g}]")
    return schedule


class RemedySettings(_Frozen):
    """What a reinforcement job does against a flattening curve (each off by default; the client's
    `PipelineTrainer` has the same options, `artlike._remedies` their math). Schedules run over iterations."""

    dynamic_sampling: DynamicSampling | None = None  # an iteration rolls out more rows until enough groups differ
    entropy_coef: float | None = Field(None, ge=0.0)  # the GRPO step's entropy bonus
    # the entropy bonus moved after each iteration towards a target sampling entropy (starts at entropy_coef)
    entropy_control: EntropyControl | None = None
    epsilon_high: float | None = Field(None, ge=0.0, le=10.0)  # the GRPO clip's upper bound (clip-higher)
    clip_cov_fraction: float | None = Field(None, ge=0.0, le=1.0)  # Clip-Cov: tokens left out against entropy collapse
    positive_advantage_weight: float | None = Field(None, ge=0.0, le=10.0)  # W-REINFORCE: right samples weigh less
    temperature_schedule: Schedule | None = None  # the rollouts' temperature (replaces rollout.temperature)
    group_size_schedule: Schedule | None = None  # rollouts per row (replaces rollout.group_size)
    learning_rate_schedule: Schedule | None = None  # each step's learning rate (replaces learning_rate)
    # a row field with a reference answer: it joins a group whose rollouts all failed (`guidance.py`)
    guide_field: str | None = Field(None, min_length=1, max_length=200)

    @field_validator("temperature_schedule")
    @classmethod
    def _temperature_in_range(cls, schedule: Schedule | None) -> Schedule | None:
        return _within(schedule, 0.0, 2.0)

    @field_validator("group_size_schedule")
    @classmethod
    def _group_size_in_range(cls, schedule: Schedule | None) -> Schedule | None:
        return _within(schedule, 2, 64)

    @field_validator("learning_rate_schedule")
    @classmethod
    def _learning_rate_positive(cls, schedule: Schedule | None) -> Schedule | None:
        return _within(schedule, 0.0, math.inf)

    def train_options(self) -> dict[str, float]:
        """The step's GRPO options that these settings set."""
        options = {"entropy_coef": self.entropy_coef, "epsilon_high": self.epsilon_high,
                   "clip_cov_fraction": self.clip_cov_fraction,
                   "positive_advantage_weight": self.positive_advantage_weight}
        return {name: value for name, value in options.items() if value is not None}


@dataclass(frozen=True)
class IterationSettings:
    temperature: float
    group_size: int
    learning_rate: float


class JobSpec(_Frozen):
    api: Literal["openai", "motterl"]
    method: Literal["reinforcement", "supervised", "dpo"]
    base_model: str  # the served base model
    target_model: str  # the trainable model the job trains (its fine_tuned_model)
    create_target: bool  # register target_model first (False: train an existing trainable model in place)
    reward: Reward | None = None  # reinforcement only
    iterations: int = Field(ge=1, le=100_000)  # reinforcement: GRPO steps; supervised/dpo: epochs
    batch_size: int = Field(DEFAULT_BATCH_SIZE, ge=1, le=256)  # rows per iteration
    learning_rate: float = Field(DEFAULT_LEARNING_RATE, gt=0.0)
    seed: int = 0
    rollout: RolloutSettings = RolloutSettings()
    eval: EvalSettings = EvalSettings()
    remedies: RemedySettings = RemedySettings()
    train_rows: int = Field(ge=1)
    validation_rows: int = 0
    hyperparameters: dict[str, Any] = Field(default_factory=dict)  # as the request gave them, for the job object

    def iteration_settings(self, iteration: int) -> IterationSettings:
        """The temperature, group size and learning rate of iteration `iteration` (0-based), schedules applied.

        >>> spec = JobSpec(api="openai", method="reinforcement", base_model="b", target_model="t",
        ...                create_target=True, iterations=4, train_rows=1, learning_rate=1e-4,
        ...                remedies=RemedySettings(temperature_schedule=Schedule(start=1.2, end=1.0, steps=2),
        ...                                        group_size_schedule=Schedule(start=4, end=8, steps=2)))
        >>> [spec.iteration_settings(i) for i in (0, 1, 3)]  # doctest: +NORMALIZE_WHITESPACE
        [IterationSettings(temperature=1.2, group_size=4, learning_rate=0.0001),
         IterationSettings(temperature=1.1, group_size=6, learning_rate=0.0001),
         IterationSettings(temperature=1.0, group_size=8, learning_rate=0.0001)]
        """
        remedies = self.remedies
        return IterationSettings(
            temperature=(self.rollout.temperature if remedies.temperature_schedule is None
                         else round(remedies.temperature_schedule.at(iteration), 6)),
            group_size=(self.rollout.group_size if remedies.group_size_schedule is None
                        else remedies.group_size_schedule.at_int(iteration)),
            learning_rate=(self.learning_rate if remedies.learning_rate_schedule is None
                           else remedies.learning_rate_schedule.at(iteration)))

    def learning_rate_warning(self) -> str | None:
        low, high = LEARNING_RATES_SEEN_WORKING
        if low <= self.learning_rate <= high:
            return None
        return (f"learning rate {self.learning_rate:g} is outside the range LoRA GRPO has been seen to work in "
                f"({low:g} to {high:g}); the job uses it as given")
