"""How a training batch is cut: into optimizer steps (balanced by trainable tokens) and micro-batches.

Micro-batches are right-padded [B, T_max] tensors, so their cost is B × T_max tokens, not the sum of the
lengths. A micro-batch of a prefix family (`prefixes.py`) is the shared prefix once plus the members'
remaining tokens, right-padded: P + B × max(T_i − P). Right padding needs no attention mask under a causal
mask (a real token never attends to the pads after it), which keeps SDPA on its fast causal path; packing
several sequences into one row would instead need a block-diagonal mask and pay attention over the whole
row (quadratic in the row length).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from artlike.types import TrainConfig
from artlike_server.trainer.prefixes import Family


def pack(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Indices of sequences per micro-batch, first-fit-decreasing by length under a padded-token budget.

    A micro-batch holds n sequences of max length L only while n × L <= token_budget; a sequence longer
    than the budget gets a micro-batch of its own. Within a micro-batch indices are longest first.

    >>> pack([100, 300, 200, 50], token_budget=400)
    [[1], [2, 0], [3]]
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be positive, got {token_budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    for index in order:
        for members in bins:
            # Items arrive longest first, so a bin's first member is its padded length.
            if (len(members) + 1) * lengths[members[0]] <= token_budget:
                members.append(index)
                break
        else:
            bins.append([index])
    return bins


def split_into_steps(trainable_tokens: Sequence[int], num_steps: int) -> list[list[int]]:
    """Indices of sequences per optimizer step, each step getting about the same number of trainable tokens.

    Longest-processing-time greedy: sequences by decreasing trainable tokens, each to the lightest step so
    far. Never returns an empty step: with fewer sequences than steps, there are fewer steps. Indices inside
    a step are in their original order.

    >>> split_into_steps([5, 1, 4, 2], num_steps=2)
    [[0, 1], [2, 3]]
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be positive, got {num_steps}")
    steps: list[list[int]] = [[] for _ in range(min(num_steps, len(trainable_tokens)))]
    totals = [0] * len(steps)
    for index in sorted(range(len(trainable_tokens)), key=lambda i: (-trainable_tokens[i], i)):
        lightest = min(range(len(steps)), key=lambda s: (totals[s], s))
        steps[lightest].append(index)
        totals[lightest] += trainable_tokens[index]
    return [sorted(step) for step in steps]


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


def plan_optimizer_steps(
    trainable_tokens: Sequence[int],
    *,
    epochs: int,
    steps_per_epoch: int,
    units: Sequence[Sequence[int]] | None = None,
) -> list[list[int]]:
    """All optimizer steps of a job: `epochs` passes over the same split of the batch; `units` (`units_of`)
    are never split between steps."""
    if units is None:
        units = [[index] for index in range(len(trainable_tokens))]
    per_unit = split_into_steps([sum(trainable_tokens[i] for i in unit) for unit in units], steps_per_epoch)
    per_epoch = [sorted(index for u in step for index in units[u]) for step in per_unit]
    return [list(step) for _ in range(epochs) for step in per_epoch]


def pack_units(units: Sequence[Sequence[int]], lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """`pack` for units that must share a micro-batch (preference pairs): first-fit-decreasing by a unit's
    longest member, a micro-batch holding its units while rows × longest length <= token_budget.

    >>> pack_units([[0, 1], [2, 3], [4, 5]], [100, 80, 30, 50, 60, 60], token_budget=300)
    [[0, 1], [4, 5, 2, 3]]
    """
    longest = [max(lengths[i] for i in unit) for unit in units]
    order = sorted(range(len(units)), key=lambda u: (-longest[u], u))
    bins: list[list[int]] = []  # unit indices; the first is the longest
    for u in order:
        for members in bins:
            rows = sum(len(units[m]) for m in members) + len(units[u])
            if rows * longest[members[0]] <= token_budget:
                members.append(u)
                break
        else:
            bins.append([u])
    return [[index for u in members for index in units[u]] for members in bins]


@dataclass(frozen=True)
class MicroBatchPlan:
    """Sequences (indices, longest first) that go through one forward/backward, and the prefix they share."""

    members: tuple[int, ...]
    prefix_length: int = 0


def plan_micro_batches(
    lengths: Sequence[int], families: Sequence[Family], token_budget: int
) -> list[MicroBatchPlan]:
    """Micro-batches for `families` (of the sequences whose token counts are `lengths`) under `token_budget`.

    A family with a shared prefix of P tokens fills micro-batches of its own, each costing
    P + B × (longest member − P) and holding at least one member (each recomputes the prefix). Sequences
    without a family are packed together as before (`pack`).

    >>> plan_micro_batches([50, 60, 70, 20], [Family((0, 1, 2), 40), Family((3,), 0)], token_budget=100)
    [MicroBatchPlan(members=(2, 1), prefix_length=40), MicroBatchPlan(members=(0,), prefix_length=40), \
MicroBatchPlan(members=(3,), prefix_length=0)]
    """
    plans: list[MicroBatchPlan] = []
    alone: list[int] = []
    for family in families:
        if family.prefix_length == 0:
            alone.extend(family.members)
            continue
        prefix = family.prefix_length
        members = sorted(family.members, key=lambda i: (-lengths[i], i))
        chunk: list[int] = []
        for index in members:
            # members arrive longest first: the chunk's first member sets its padded suffix length
            if chunk and prefix + (len(chunk) + 1) * (lengths[chunk[0]] - prefix) > token_budget:
                plans.append(MicroBatchPlan(tuple(chunk), prefix))
                chunk = []
            chunk.append(index)
        plans.append(MicroBatchPlan(tuple(chunk), prefix))
    for members in pack([lengths[i] for i in alone], token_budget):
        plans.append(MicroBatchPlan(tuple(alone[i] for i in members)))
    return plans
