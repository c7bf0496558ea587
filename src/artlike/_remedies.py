"""What `PipelineTrainer` can do against a learning curve that flattens: its options and their pure math.

GRPO learns only from groups whose rewards differ. When the policy becomes nearly deterministic per prompt,
most groups are all-right or all-wrong and the step carries little signal. The options here act on that:

- `DynamicSampling` (DAPO): a step drops groups without reward variance and waits for more, up to a bound.
- `PassRateCurriculum` with `CurriculumSampler`: the next scenario is one whose recent pass rate is strictly
  between 0 and 1 (unseen scenarios first, so the whole pool is explored).
- `RetryFailedGroups`: a group none of whose rollouts passed is rolled out again at a hotter temperature,
  and a retry in which one passes joins it (exploration where the policy is sure and wrong).
- `EntropyControl`: an entropy bonus whose coefficient rises while the sampled tokens' entropy is under a
  target and falls while it is over (adaptive entropy control, as in Skywork-OR1), where a fixed coefficient
  fades as the policy sharpens.
- `Schedule`: a value over the run's steps, linear or cosine, with warmup: the sampling temperature, the
  group size, and the learning rate of each step (a run-level schedule: each `model.train` call of the
  pipeline is one step, so the train config's own `lr_schedule` acts within one call only).
"""

from __future__ import annotations

import contextvars
import math
import random
from collections import deque
from collections.abc import Hashable, Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["CurriculumSampler", "DynamicSampling", "EntropyControl", "PassRateCurriculum", "RetryFailedGroups", "Schedule",
           "rollout_temperature"]


class _Options(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Schedule(_Options):
    """A value over the run's steps: `start` at step 0, `end` from step `steps` on, linear or cosine in between;
    with `warmup_steps`, it rises linearly from 0 to `start` first (a learning-rate warmup)."""

    start: float = Field(description="The value at step 0 (after the warmup).")
    end: float = Field(description="The value from step `steps` on.")
    steps: int = Field(ge=1, description="Steps from start to end (after the warmup).")
    shape: Literal["linear", "cosine"] = "linear"
    warmup_steps: int = Field(0, ge=0, description="Steps rising linearly towards `start` before the schedule.")

    def at(self, step: int) -> float:
        """The value at step `step` (0-based: the steps done before it).

        >>> Schedule(start=1.2, end=0.8, steps=4).at(0), Schedule(start=1.2, end=0.8, steps=4).at(2)
        (1.2, 1.0)
        >>> Schedule(start=1.2, end=0.8, steps=4).at(9)
        0.8
        >>> [round(Schedule(start=1.0, end=0.0, steps=4, shape="cosine", warmup_steps=1).at(s), 3) for s in range(6)]
        [0.5, 1.0, 0.854, 0.5, 0.146, 0.0]
        """
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if step < self.warmup_steps:
            return self.start * (step + 1) / (self.warmup_steps + 1)
        progress = min(1.0, (step - self.warmup_steps) / self.steps)
        if self.shape == "cosine":
            progress = 0.5 * (1.0 - math.cos(math.pi * progress))
        return self.start + (self.end - self.start) * progress

    def at_int(self, step: int) -> int:
        """The value at `step` rounded to an integer (a group size), at least 1.

        >>> [Schedule(start=4, end=8, steps=4).at_int(s) for s in range(6)]
        [4, 5, 6, 7, 8, 8]
        """
        return max(1, round(self.at(step)))


class DynamicSampling(_Options):
    """DAPO's dynamic sampling: a step keeps only groups whose rewards differ and waits for more until it has
    `min_signal_groups` of them (default: `groups_per_step`), having looked at no more than
    `max_resample_factor` × `groups_per_step` groups; then it trains what it has. The dropped groups are
    counted in the step's `zero_variance_groups`."""

    min_signal_groups: int | None = Field(None, ge=1, description="Groups with reward variance a step waits "
                                          "for (default: groups_per_step, at most that).")
    max_resample_factor: float = Field(3.0, ge=1.0, le=100.0, description="The bound: a step looks at no more "
                                       "than this × groups_per_step groups.")

    def signal_groups_wanted(self, groups_per_step: int) -> int:
        """The groups with reward variance a step waits for.

        >>> DynamicSampling().signal_groups_wanted(8), DynamicSampling(min_signal_groups=20).signal_groups_wanted(8)
        (8, 8)
        """
        return min(groups_per_step, self.min_signal_groups or groups_per_step)

    def max_groups_examined(self, groups_per_step: int) -> int:
        """The most groups a step looks at: the last one is trained even without variance.

        >>> DynamicSampling(max_resample_factor=2.5).max_groups_examined(8)
        20
        """
        return max(groups_per_step, math.ceil(self.max_resample_factor * groups_per_step))


class RetryFailedGroups(_Options):
    """Exploration where the policy is sure and wrong. When none of a group's rollouts passes (by the
    objective's `pass_threshold`), the scenario is rolled out again at the hotter `temperature` (the rollout
    reads it with `art.rollout_temperature()`), `group_size` more times (default: the group's size), up to
    `attempts` times until a rollout passes. The retry in which one passes joins the group, which then carries
    a signal where the all-wrong group would have trained nothing; a retry in which none passes is dropped (it
    would only rank wrong answers against each other).

    The engine records each token's logprob under the policy itself, before temperature, so the retried
    samples train as the policy's own: a flatter draw from the same distribution that found a right answer."""

    temperature: float = Field(1.5, gt=0.0, le=4.0, description="The retries' sampling temperature.")
    attempts: int = Field(1, ge=1, le=8, description="Retries of one group at most, until a rollout passes.")
    group_size: int | None = Field(None, ge=1, le=1024, description="Rollouts per retry (default: the group's).")


class EntropyControl(_Options):
    """An entropy bonus that holds the sampling entropy near `target` (adaptive entropy control, from the
    Skywork-OR1 report). After each step the coefficient (`entropy_coef` of the GRPO family, starting at the
    train config's) rises by `coef_step` when the step's sampling entropy (the mean −logprob of its sampled
    tokens, nats a token) is under `target`, and falls by `coef_step` when it is over, within
    [0, `max_coef`].

    Why not a fixed coefficient: the bonus's gradient, −p·(log p + H), vanishes as the policy sharpens, so a
    coefficient that weighs against the policy gradient early is too weak once the policy is nearly sure of
    one answer; one small enough to leave early learning alone does nothing late. The controller raises it
    only while the entropy is under the target, and lets it fall back when the entropy recovers."""

    target: float = Field(gt=0.0, le=10.0, description="The sampling entropy to hold, nats a token.")
    coef_step: float = Field(5e-3, gt=0.0, le=1.0, description="The coefficient's change after each step.")
    max_coef: float = Field(0.1, gt=0.0, le=10.0, description="The coefficient's upper bound.")

    def next_coef(self, coef: float, sampling_entropy: float | None) -> float:
        """The coefficient of the next step, after a step that trained with `coef` and sampled at
        `sampling_entropy` (None: not measured, the coefficient stays).

        >>> control = EntropyControl(target=0.2, coef_step=0.01, max_coef=0.025)
        >>> control.next_coef(0.0, 0.6), control.next_coef(0.0, 0.05), control.next_coef(0.02, 0.05)
        (0.0, 0.01, 0.025)
        >>> control.next_coef(0.025, 0.3), control.next_coef(0.01, None)
        (0.015, 0.01)
        """
        if sampling_entropy is None:
            return coef
        moved = coef + self.coef_step if sampling_entropy < self.target else coef - self.coef_step
        return round(min(self.max_coef, max(0.0, moved)), 12)


def has_signal(rewards: Sequence[float | None]) -> bool:
    """Whether a group's rewards differ (a group-relative advantage is nonzero somewhere).

    >>> has_signal([1.0, 0.1, 1.0]), has_signal([0.1, 0.1]), has_signal([1.0])
    (True, False, False)
    """
    return len({r for r in rewards if r is not None}) > 1


class PassRateCurriculum(_Options):
    """Prefer scenarios whose recent pass rate (share of a group's rewards ≥ `pass_threshold`, over the last
    `window` rollouts of that scenario) is strictly between 0 and 1 ("mixed": their groups carry signal).

    While unseen scenarios remain, a draw takes the next unseen one, but for a share `revisit` of draws that
    go back to a mixed one (a pool larger than a run can walk still gets its mixed scenarios again). Once every
    scenario was seen, draws take mixed ones. With probability `explore`, a revisit draws from the whole pool
    instead (so a solved or failed scenario comes back). The scenarios form a pool drawn from again and again;
    `PipelineTrainer`'s `scenario_key` names a scenario (default: its position)."""

    pass_threshold: float = Field(1.0, description="A rollout passes when its reward is at least this.")
    window: int = Field(16, ge=1, description="Rollouts of a scenario its pass rate is counted over.")
    explore: float = Field(0.1, ge=0.0, le=1.0, description="Chance of drawing from the whole pool instead.")
    revisit: float = Field(0.5, ge=0.0, le=1.0, description="While unseen scenarios remain, the share of draws "
                           "that go back to a mixed one (0: the whole pool is seen first).")
    seed: int = 0

    @model_validator(mode="after")
    def _finite(self) -> PassRateCurriculum:
        if not math.isfinite(self.pass_threshold):
            raise ValueError("pass_threshold must be finite")
        return self


class CurriculumSampler:
    """Draws pool positions by `PassRateCurriculum`'s rule; `record` feeds it each finished group's rewards.

    >>> sampler = CurriculumSampler(["a", "b", "c"], PassRateCurriculum(explore=0.0))
    >>> sorted(sampler.draw() for _ in range(3))   # every unseen scenario first
    [0, 1, 2]
    >>> sampler.record(0, [1.0, 1.0]); sampler.record(1, [1.0, 0.0]); sampler.record(2, [0.0, 0.0])
    >>> sampler.pass_rate("b"), {sampler.draw() for _ in range(5)}   # only "b" is mixed
    (0.5, {1})
    """

    def __init__(self, keys: Sequence[Hashable], config: PassRateCurriculum) -> None:
        if not keys:
            raise ValueError("a curriculum needs at least one scenario")
        self.keys = list(keys)
        self.config = config
        self.rng = random.Random(config.seed)
        self.outcomes: dict[Hashable, deque[bool]] = {}
        self.unseen = list(range(len(self.keys)))  # positions never drawn, in order
        self.rng.shuffle(self.unseen)
        self.position: dict[Hashable, int] = {}  # each key's first position (duplicates share a pass rate)
        for index, key in enumerate(self.keys):
            self.position.setdefault(key, index)
        self.mixed: dict[Hashable, None] = {}  # the keys whose pass rate is mixed now, in insertion order

    def pass_rate(self, key: Hashable) -> float | None:
        """The recent pass rate of scenario `key`, None before any of its rollouts finished."""
        outcomes = self.outcomes.get(key)
        return sum(outcomes) / len(outcomes) if outcomes else None

    def record(self, position: int, rewards: Sequence[float | None]) -> None:
        """Count a finished group of the scenario at `position` (rewards of None are left out)."""
        key = self.keys[position]
        window = self.outcomes.setdefault(key, deque(maxlen=self.config.window))
        window.extend(r >= self.config.pass_threshold for r in rewards if r is not None)
        if 0.0 < (self.pass_rate(key) or 0.0) < 1.0:
            self.mixed[key] = None
        else:
            self.mixed.pop(key, None)

    def draw(self) -> int:
        """The pool position of the next scenario: an unseen one (but for a share `revisit` while mixed ones
        exist), else a mixed one (but for `explore`: any).

        >>> sampler = CurriculumSampler(list(range(100)), PassRateCurriculum(revisit=1.0, explore=0.0))
        >>> first = sampler.draw(); sampler.record(first, [1.0, 0.0])   # mixed: every draw goes back to it
        >>> {sampler.draw() for _ in range(5)} == {first}
        True
        >>> sampler.record(first, [1.0] * 16); sampler.draw() != first   # solved: unseen ones again
        True
        """
        if self.unseen and (not self.mixed or self.rng.random() >= self.config.revisit):
            return self.unseen.pop()
        if self.mixed and self.rng.random() >= self.config.explore:
            return self.position[self.rng.choice(list(self.mixed))]
        return self.rng.randrange(len(self.keys))

    def distribution(self) -> dict[str, int]:
        """How many scenarios are unseen, all-wrong, mixed and all-right by their recent pass rate.

        >>> sampler = CurriculumSampler([0, 1], PassRateCurriculum()); sampler.record(0, [0.0])
        >>> sampler.distribution()
        {'unseen': 1, 'all_wrong': 1, 'mixed': 0, 'all_right': 0}
        """
        counts = {"unseen": 0, "all_wrong": 0, "mixed": 0, "all_right": 0}
        for key in dict.fromkeys(self.keys):
            rate = self.pass_rate(key)
            counts["unseen" if rate is None else "all_wrong" if rate == 0 else "all_right" if rate == 1
                   else "mixed"] += 1
        return counts


_temperature: contextvars.ContextVar[float | None] = contextvars.ContextVar("artlike_rollout_temperature",
                                                                           default=None)


def rollout_temperature(default: float = 1.0) -> float:
    """The sampling temperature a `PipelineTrainer` with a `temperature` schedule gives the rollout running now
    (inside `rollout(scenario)`), else `default`: pass it to the chat request.

    >>> rollout_temperature(0.7)
    0.7
    """
    value = _temperature.get()
    return default if value is None else value


def set_rollout_temperature(value: float | None) -> None:
    """Set the temperature of the rollouts started from the current task (a new task copies it)."""
    _temperature.set(value)
