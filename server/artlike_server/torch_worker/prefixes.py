"""Shared prompt prefixes: a group's common prompt goes through the decoder once per micro-batch, not once per sample.

Every trajectory of a GRPO group starts with the same prompt (system message, tool specs, the task), and
only tokens after it are trained. A *family* is a set of sequences whose first p tokens are identical and
need no logit (no trained token is predicted from them). The trainer runs the decoder over those p tokens
once, keeps their keys and values (a KV cache that carries gradient), and runs each member's remaining
tokens attending to them: the same logprobs and gradients as running every sequence whole
(tests/unit/test_prefixes.py checks both), for fewer positions:

    decoder positions of a family   p + Σ_i (n_i − p)      instead of   Σ_i n_i
    (n_i = positions of sequence i: its length − 1; the last token is only ever a target)

Measured need: the email agent's prompt is ~1,400 tokens and a turn adds ~100-300, so a group of 4
trajectories (5 sequences) costs ~2,900 positions instead of ~7,500; an arithmetic group of 8 samples
shares ~90 of its ~110 tokens per sample.

Which sequences form families is a pure planning step (`plan_families`): sort the sequences (members of
a family are then neighbours), and split the sorted list into contiguous runs by dynamic programming on
the cost above plus `call_overhead` per family (a family is a separate forward pass: a prefix shared by
two sequences for 5 tokens is not worth one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

DEFAULT_CALL_OVERHEAD = 64
"""What one extra forward pass costs, in decoder positions; measured per-call overhead on CPU is small, this
mostly keeps families from forming over a few shared template tokens."""


@dataclass(frozen=True)
class Family:
    """Sequences (indices into the planned list) that share their first `prefix_length` tokens.

    `prefix_length` is 0 for a sequence trained on its own.
    """

    members: tuple[int, ...]
    prefix_length: int


def first_needed_position(trainable: Sequence[bool]) -> int | None:
    """The first position whose hidden state predicts a trained token (the token after it is trainable).

    None when nothing is trainable: the first token is never a target, so `trainable[0]` does not count.

    >>> first_needed_position([False, False, False, True, True])
    2
    """
    for index in range(1, len(trainable)):
        if trainable[index]:
            return index - 1
    return None


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` have in common.

    >>> common_prefix_length([1, 2, 3, 4], [1, 2, 5])
    2
    """
    length = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        length += 1
    return length


def plan_families(
    token_ids: Sequence[Sequence[int]],
    first_needed: Sequence[int],
    *,
    call_overhead: int = DEFAULT_CALL_OVERHEAD,
) -> list[Family]:
    """Split sequences into families that minimise decoder positions (see the module docstring).

    `first_needed[i]` is `first_needed_position` of sequence i (every sequence must have a trainable token).
    A family's prefix is the tokens all its members share, cut at the earliest first-needed position, so
    each member keeps at least one position of its own. Families are returned in sorted-sequence order.

    >>> plan_families([[1, 2, 3, 4, 9], [7, 8], [1, 2, 3, 4, 5, 6]], [3, 0, 3], call_overhead=0)
    [Family(members=(0, 2), prefix_length=3), Family(members=(1,), prefix_length=0)]
    """
    count = len(token_ids)
    if len(first_needed) != count:
        raise ValueError("token_ids and first_needed differ in length")
    if any(not 0 <= first_needed[i] <= len(token_ids[i]) - 2 for i in range(count)):
        raise ValueError("every sequence needs a trained token after its first")
    order = sorted(range(count), key=lambda i: (list(token_ids[i]), i))
    positions = [len(token_ids[i]) - 1 for i in order]
    # What neighbours in sorted order may share: their common tokens, cut before either needs a logit.
    shareable = [
        min(common_prefix_length(token_ids[a], token_ids[b]), first_needed[a], first_needed[b])
        for a, b in pairwise(order)
    ]
    # best[end]: the fewest positions for order[:end]; choice[end]: where its last family starts, and its prefix.
    best = [0] * (count + 1)
    choice: list[tuple[int, int]] = [(0, 0)] * (count + 1)
    for end in range(1, count + 1):
        best[end] = best[end - 1] + positions[end - 1]  # the last sequence alone
        choice[end] = (end - 1, 0)
        prefix = positions[end - 1]  # no bound yet: the first pair sets it
        run_positions = positions[end - 1]
        for start in range(end - 2, -1, -1):
            prefix = min(prefix, shareable[start])
            if prefix <= 0:
                break  # a run's shared prefix only shrinks as it grows
            run_positions += positions[start]
            members = end - start
            cost = best[start] + call_overhead + prefix + run_positions - members * prefix
            if cost < best[end]:
                best[end] = cost
                choice[end] = (start, prefix)
    families: list[Family] = []
    end = count
    while end > 0:
        start, prefix = choice[end]
        families.append(Family(tuple(sorted(order[start:end])), prefix))
        end = start
    families.reverse()
    return families
