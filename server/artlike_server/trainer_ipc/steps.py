"""How many optimizer steps a job makes, counted alike by the server (to report progress before the worker
starts) and by the worker (which plans them: `torch_worker.packing.plan_optimizer_steps`)."""

from __future__ import annotations

from collections.abc import Sequence

from artlike.types import TrainConfig


def count_gradient_steps(num_units: int, config: TrainConfig) -> int:
    """How many optimizer steps a job of `num_units` units (`units_of`) makes (as `plan_optimizer_steps`)."""
    return config.epochs * min(config.gradient_steps_per_epoch, num_units)


def units_of(group_indices: Sequence[int], preferences: Sequence[int]) -> list[list[int]]:
    """The indices that must stay together in one optimizer step and micro-batch: the two sequences of each
    preference pair (same group index, preference ±1), every other sequence alone; in first-seen order.

    >>> units_of([0, 0, 1, 1, 7], [1, -1, -1, 1, 0])
    [[0, 1], [2, 3], [4]]
    """
    units: list[list[int]] = []
    pair_unit: dict[int, list[int]] = {}
    for index, (group, preference) in enumerate(zip(group_indices, preferences, strict=True)):
        if preference == 0:
            units.append([index])
        elif group in pair_unit:
            pair_unit[group].append(index)
        else:
            pair_unit[group] = [index]
            units.append(pair_unit[group])
    return units
