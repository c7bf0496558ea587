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

from artlike_server.torch_worker.prefixes import Family


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


def plan_optimizer_steps(
    trainable_tokens: Sequence[int],
    *,
    epochs: int,
    steps_per_epoch: int,
    units: Sequence[Sequence[int]] | None = None,
) -> list[list[int]]:
    """All optimizer steps of a job: `epochs` passes over the same split of the batch; `units` (`trainer_ipc.steps.units_of`)
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
    """Sequences (indices) that go through one forward/backward, and the prefixes they share.

    `families` cuts `members` in order: (P, n) says the next n members continue one shared prefix of P
    tokens (`prefixes.py`); the prefixes of all families run through the decoder together, once, and each
    member runs only what follows its own. Members past the families run whole.
    """

    members: tuple[int, ...]
    families: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if sum(count for _, count in self.families) > len(self.members) or any(
            p < 1 or n < 1 for p, n in self.families
        ):
            raise ValueError(f"families {self.families} do not cut {len(self.members)} members")

    def prefixes(self) -> list[int]:
        """Each member's shared-prefix length (0: it runs whole), in the order of `members`."""
        lengths = [p for p, n in self.families for _ in range(n)]
        return lengths + [0] * (len(self.members) - len(lengths))

    def decoder_positions(self, lengths: Sequence[int]) -> int:
        """Positions the decoder runs, padding included, for sequences of `lengths` tokens (`MicroBatch`)."""
        prefixes = self.prefixes()
        longest_prefix = max((p for p, _ in self.families), default=0)
        longest_rest = max(lengths[m] - p for m, p in zip(self.members, prefixes, strict=True))
        return len(self.families) * longest_prefix + len(self.members) * (longest_rest - 1)


def plan_micro_batches(
    lengths: Sequence[int], families: Sequence[Family], token_budget: int
) -> list[MicroBatchPlan]:
    """Micro-batches for `families` (of the sequences whose token counts are `lengths`) under `token_budget`.

    A family with a shared prefix of P tokens is cut into chunks that each fit the budget alone
    (P + B × (longest member − P), at least one member each; each chunk recomputes the prefix). Chunks then
    share micro-batches (`pack_families`): many small groups (8 prompts × 8 samples) run as one batched
    decoder call instead of one small call each, which is what CPU matmuls of a small model need. Sequences
    without a family are packed together as before (`pack`).

    >>> plan_micro_batches([50, 60, 70, 20], [Family((0, 1, 2), 40), Family((3,), 0)], token_budget=100)
    [MicroBatchPlan(members=(2, 1), families=((40, 2),)), MicroBatchPlan(members=(0,), families=((40, 1),)), \
MicroBatchPlan(members=(3,), families=())]
    """
    chunks: list[tuple[int, tuple[int, ...]]] = []
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
                chunks.append((prefix, tuple(chunk)))
                chunk = []
            chunk.append(index)
        chunks.append((prefix, tuple(chunk)))
    plans = pack_families(chunks, lengths, token_budget)
    for members in pack([lengths[i] for i in alone], token_budget):
        plans.append(MicroBatchPlan(tuple(alone[i] for i in members)))
    return plans


def pack_families(chunks: Sequence[tuple[int, Sequence[int]]], lengths: Sequence[int],
                  token_budget: int) -> list[MicroBatchPlan]:
    """Prefix families (prefix length, members) into shared micro-batches, first-fit-decreasing by prefix
    length under the padded cost F × longest prefix + B × longest remainder (`MicroBatchPlan.decoder_positions`).

    >>> pack_families([(40, (0,)), (10, (1, 2)), (40, (3,))], [50, 20, 20, 45], token_budget=120)
    [MicroBatchPlan(members=(0, 3), families=((40, 1), (40, 1))), MicroBatchPlan(members=(1, 2), families=((10, 2),))]
    """
    def rest(chunk: tuple[int, Sequence[int]]) -> int:
        return max(lengths[m] for m in chunk[1]) - chunk[0]

    order = sorted(range(len(chunks)), key=lambda c: (-chunks[c][0], -rest(chunks[c]), c))
    bins: list[list[int]] = []
    for c in order:
        for members in bins:
            # Chunks arrive longest prefix first: a bin's first chunk has its longest prefix.
            grown = [*members, c]
            rows = sum(len(chunks[m][1]) for m in grown)
            if len(grown) * chunks[members[0]][0] + rows * max(rest(chunks[m]) for m in grown) <= token_budget:
                members.append(c)
                break
        else:
            bins.append([c])
    return [
        MicroBatchPlan(tuple(i for c in members for i in chunks[c][1]),
                       families=tuple((chunks[c][0], len(chunks[c][1])) for c in members))
        for members in bins
    ]
