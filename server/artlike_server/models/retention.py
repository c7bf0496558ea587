"""Step retention: which trained steps a model's policy lets go after a new step is committed.

A pure function of the steps on disk, the latest step, the history and the policy. Always kept: the latest
step (it is served under the alias) and step 0 (the untrained adapter, the baseline every comparison starts
from). With no rule set, every step is kept. A step is kept when any rule keeps it:

    keep_last=2                          the 2 newest steps
    keep_best={metric, mode, count}      the `count` steps whose history line has the best `metric`
                                         (a dotted path such as "reward.mean"; steps without it never win)

Worked example: steps [0, 1, 2, 3, 4, 5], latest 5, reward.mean by step {1: .2, 2: .9, 3: .4, 4: .1, 5: .3},
keep_last=2 and keep_best(reward.mean, max, 1) keep {0, 5, 4} ∪ {2}: steps 1 and 3 are deleted.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from artlike.types import StepRetention


def metric_value(entry: dict[str, Any], path: str) -> float | None:
    """The number at a dotted path of a history line (None when absent or not a finite number)."""
    value: Any = entry
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        return None
    return float(value)


def steps_to_delete(steps: Sequence[int], latest: int, history: Sequence[dict[str, Any]],
                    policy: StepRetention, also_keep: Collection[int] = ()) -> list[int]:
    if policy.keep_last is None and policy.keep_best is None:
        return []
    keep = {0, latest, *also_keep}
    ordered = sorted(steps)
    if policy.keep_last is not None:
        keep.update(ordered[-policy.keep_last:])
    if policy.keep_best is not None:
        best = policy.keep_best
        scored = [(value, entry["step"]) for entry in history
                  if entry.get("step") in steps and (value := metric_value(entry, best.metric)) is not None]
        scored.sort(key=lambda pair: pair[0], reverse=best.mode == "max")
        keep.update(step for _, step in scored[:best.count])
    return [step for step in ordered if step not in keep]
