"""Group-relative advantages (GRPO): how much better each trajectory did than its group.

For a group of G trajectories sampled for the same task, with rewards r_1..r_G:

    A_i = (r_i - mean(r)) / (std(r) + eps)        std = population std (divide by G), like ART and TRL
    A_i = r_i - mean(r)                           with scale_rewards=False (Dr. GRPO)
    A_i = λ · A_i   where A_i > 0                 with positive_weight=λ (W-REINFORCE)

The last, from Zhu et al., "The Surprising Effectiveness of Negative Reinforcement in LLM Reasoning": a step
that pushes down the wrong samples spreads their probability over the model's other answers in proportion
to what it already believes, while a step that pushes up the right ones concentrates it. Weighing the right
samples less (λ = 0.1 in the paper) keeps the policy's spread of answers, its entropy, for longer.

Plain Python on purpose: the server computes advantages when it builds a training batch, and the server
process never imports torch (only the trainer worker does; `grpo.py` holds the loss).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def group_advantages(
    rewards: Sequence[float], *, scale_rewards: bool = True, positive_weight: float = 1.0, eps: float = 1e-4
) -> list[float]:
    """Advantages of one group: rewards minus the group mean, divided by the population std when scaling,
    the positive ones times `positive_weight`.

    >>> group_advantages([1.0, 0.0, 0.0, 1.0])   # mean 0.5, std 0.5
    [0.9998000399920016, -0.9998000399920016, -0.9998000399920016, 0.9998000399920016]
    >>> group_advantages([1.0, 0.0, 0.0, 0.0], scale_rewards=False, positive_weight=0.5)  # mean 0.25
    [0.375, -0.25, -0.25, -0.25]
    """
    if not rewards:
        return []
    if is_zero_variance(rewards):  # exactly 0, not rounding noise divided by eps
        return [0.0] * len(rewards)
    mean = math.fsum(rewards) / len(rewards)
    centred = [r - mean for r in rewards]
    if scale_rewards:
        std = math.sqrt(math.fsum(c * c for c in centred) / len(rewards))
        centred = [c / (std + eps) for c in centred]
    return [a * positive_weight if a > 0 else a for a in centred]


def is_zero_variance(rewards: Sequence[float]) -> bool:
    """True when every reward of the group is equal: all advantages are 0 and the group carries no signal."""
    return all(r == rewards[0] for r in rewards)
