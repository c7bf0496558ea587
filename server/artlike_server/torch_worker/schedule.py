"""The learning rate of each optimizer step of a job: linear warmup, then constant or cosine decay.

With base rate η, W warmup steps and S steps in all, step s (1-based) uses

    s ≤ W:   η · s / (W + 1)                                 warmup: never 0, reaching η after it
    s > W:   η                                               "constant"
             η · ½ (1 + cos(π · (s − W − 1) / (S − W)))      "cosine": η at the first step after warmup,
                                                             decaying towards 0 (never reaching it)
"""

from __future__ import annotations

import math
from typing import Literal


def learning_rate_at(step: int, total_steps: int, base: float, *, schedule: Literal["constant", "cosine"],
                     warmup_steps: int = 0) -> float:
    """The learning rate of optimizer step `step` (1-based) of `total_steps`.

    >>> [round(learning_rate_at(s, 5, 1.0, schedule="cosine", warmup_steps=1), 3) for s in range(1, 6)]
    [0.5, 1.0, 0.854, 0.5, 0.146]
    >>> learning_rate_at(3, 3, 2e-5, schedule="constant")
    2e-05
    """
    if not 1 <= step <= total_steps:
        raise ValueError(f"step {step} outside 1..{total_steps}")
    if step <= warmup_steps:
        return base * step / (warmup_steps + 1)
    if schedule == "constant":
        return base
    decay_steps = total_steps - warmup_steps
    return base * 0.5 * (1.0 + math.cos(math.pi * (step - warmup_steps - 1) / decay_steps))
