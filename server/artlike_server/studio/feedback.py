"""From ratings to training signal: rewards, GRPO groups, DPO pairs, and the promotion guard's shift.

Pure functions (no I/O), each with a worked example in tests/unit/test_studio_feedback.py.

Rewards in [0, 1]:  thumb up 1 / down 0;  scale v in 1..5 -> (v - 1) / 4;  ranking of n answers, best
first -> 1 - position / (n - 1);  skip -> None (no signal).

GRPO groups: the answers of one prompt form a group when their rewards differ (the usual GRPO baseline:
the prompt's mean). People rarely rate several answers of one prompt, so every other answer (a prompt
rated once, or only with equal rewards) goes into one pooled group whose baseline is the batch mean: a
rated answer then still says "better / worse than what this model usually gets".

    answers (prompt, reward): (a, 1) (a, 0) (b, 1) (c, 0) (d, 1) (d, 1)
    -> groups [(a, 1), (a, 0)] and the pool [(b, 1), (c, 0), (d, 1), (d, 1)]

DPO pairs: within one prompt, every (better, worse) pair of answers, largest margin first.

Guard shift: for held-out rated answers, Δ_i = mean per token of (logπ_candidate − logπ_live) on answer i.
shift = mean(Δ | reward above the mean) − mean(Δ | reward below the mean): positive when the candidate
moved toward what people preferred, relative to the step being served.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations
from typing import Any

ZERO_VARIANCE = 1e-9


def rating_reward(kind: str, value: Any, *, rank: int | None = None, ranked: int | None = None) -> float | None:
    """The reward in [0, 1] of one rating (`rank` 0 = best of `ranked` answers, for a ranking)."""
    if kind == "thumb":
        return 1.0 if value == "up" else 0.0
    if kind == "scale":
        return (int(value) - 1) / 4
    if kind == "ranking":
        assert rank is not None and ranked is not None and ranked >= 2
        return 1.0 - rank / (ranked - 1)
    if kind == "skip":
        return None
    raise ValueError(f"unknown rating kind {kind!r}")


@dataclass(frozen=True)
class RatedAnswer:
    """One rated completion: its rewards averaged over raters."""

    completion_id: int
    trajectory_id: str
    prompt_key: str
    reward: float


def _has_signal(rewards: Sequence[float]) -> bool:
    return len(rewards) >= 2 and max(rewards) - min(rewards) > ZERO_VARIANCE


def grpo_groups(answers: Sequence[RatedAnswer]) -> list[list[RatedAnswer]]:
    """Per-prompt groups whose rewards differ, then one pooled group of the rest (if it has signal)."""
    by_prompt: dict[str, list[RatedAnswer]] = {}
    for answer in answers:
        by_prompt.setdefault(answer.prompt_key, []).append(answer)
    groups: list[list[RatedAnswer]] = []
    pool: list[RatedAnswer] = []
    for group in by_prompt.values():
        if _has_signal([a.reward for a in group]):
            groups.append(group)
        else:
            pool.extend(group)
    if _has_signal([a.reward for a in pool]):
        groups.append(pool)
    return groups


def dpo_pairs(answers: Sequence[RatedAnswer], *, max_per_prompt: int = 8) -> list[tuple[RatedAnswer, RatedAnswer]]:
    """(better, worse) pairs of answers of the same prompt, the largest margins first."""
    by_prompt: dict[str, list[RatedAnswer]] = {}
    for answer in answers:
        by_prompt.setdefault(answer.prompt_key, []).append(answer)
    pairs: list[tuple[RatedAnswer, RatedAnswer]] = []
    for group in by_prompt.values():
        ordered = sorted(
            ((a, b) if a.reward > b.reward else (b, a) for a, b in combinations(group, 2)
             if abs(a.reward - b.reward) > ZERO_VARIANCE),
            key=lambda pair: (-(pair[0].reward - pair[1].reward), pair[0].completion_id, pair[1].completion_id))
        pairs.extend(ordered[:max_per_prompt])
    return pairs


def preference_shift(rewards: Sequence[float], deltas: Sequence[float]) -> float | None:
    """mean(Δ | reward > mean) − mean(Δ | reward < mean); None when the rewards are all equal."""
    if len(rewards) != len(deltas):
        raise ValueError("one Δ per reward")
    if not _has_signal(rewards):
        return None
    mean = statistics.fmean(rewards)
    above = [d for r, d in zip(rewards, deltas, strict=True) if r > mean + ZERO_VARIANCE]
    below = [d for r, d in zip(rewards, deltas, strict=True) if r < mean - ZERO_VARIANCE]
    return statistics.fmean(above) - statistics.fmean(below)


def is_holdout(prompt_key: str, fraction: float) -> bool:
    """A stable split of prompts: the same prompt is always on the same side (prompt_key is a hex digest)."""
    return int(prompt_key[:8], 16) / 0xFFFFFFFF < fraction
