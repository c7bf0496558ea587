"""What a batch of rewarded groups says about why learning slows: how many groups carry no signal, how the
prompts' pass rates spread, how long and how random the sampled answers were.

Plain Python (the server process never imports torch). The trainer reports its own side per gradient step:
the policy's entropy and the KL to the base model (`torch_worker/loop.py`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .advantages import is_zero_variance


@dataclass(frozen=True)
class GroupStatistics:
    """Counts over the groups whose rewards are all known (a reward model's groups are left out)."""

    groups: int
    zero_variance: int  # every reward of the group equal: advantage 0, no signal
    all_wrong: int  # no trajectory reached the pass threshold
    mixed: int
    all_right: int  # every trajectory reached it
    pass_rate: float | None  # fraction of all trajectories that reached it; None without groups
    pass_threshold: float  # a trajectory passes when its reward is at least this

    @property
    def zero_variance_fraction(self) -> float | None:
        return self.zero_variance / self.groups if self.groups else None


def group_statistics(rewards_by_group: Sequence[Sequence[float | None]], pass_threshold: float) -> GroupStatistics:
    """Zero-variance groups and the per-prompt pass distribution; a trajectory passes when its reward is at
    least `pass_threshold`. Groups with an unknown reward (None) or no trajectory are not counted.

    >>> s = group_statistics([[1.0, 0.1], [0.1, 0.1], [1.0, 1.0]], pass_threshold=0.5)
    >>> (s.groups, s.zero_variance, s.all_wrong, s.mixed, s.all_right, s.pass_rate)
    (3, 2, 1, 1, 1, 0.5)
    """
    known = [[r for r in group if r is not None] for group in rewards_by_group
             if group and all(r is not None for r in group)]
    zero_variance = all_wrong = all_right = passed = trajectories = 0
    for rewards in known:
        zero_variance += is_zero_variance(rewards)
        passing = sum(r >= pass_threshold for r in rewards)
        all_wrong += passing == 0
        all_right += passing == len(rewards)
        passed += passing
        trajectories += len(rewards)
    return GroupStatistics(
        groups=len(known), zero_variance=zero_variance, all_wrong=all_wrong,
        mixed=len(known) - all_wrong - all_right, all_right=all_right,
        pass_rate=passed / trajectories if trajectories else None, pass_threshold=pass_threshold,
    )


@dataclass(frozen=True)
class SampleStatistics:
    response_tokens_mean: float | None  # completion tokens per trajectory
    sampling_entropy: float | None  # mean −logprob of the sampled tokens under the policy that sampled them


def sample_statistics(logprobs_by_trajectory: Sequence[Sequence[float]]) -> SampleStatistics:
    """From each trajectory's sampled-token logprobs (all its completions' output tokens): the mean response
    length, and the sampling policy's entropy estimate (the mean surprise −log π(token) of what it sampled,
    an unbiased estimate of its per-token entropy). Non-finite logprobs are left out of the entropy.

    >>> sample_statistics([[-0.5, -1.5], [-1.0, -1.0, -1.0, float("nan")]])
    SampleStatistics(response_tokens_mean=3.0, sampling_entropy=1.0)
    """
    if not logprobs_by_trajectory:
        return SampleStatistics(None, None)
    finite = [-lp for logprobs in logprobs_by_trajectory for lp in logprobs if math.isfinite(lp)]
    return SampleStatistics(
        response_tokens_mean=sum(map(len, logprobs_by_trajectory)) / len(logprobs_by_trajectory),
        sampling_entropy=math.fsum(finite) / len(finite) if finite else None,
    )
