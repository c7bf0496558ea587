"""Micro-batch packing and the split of a batch into optimizer steps."""

from __future__ import annotations

import pytest
from artlike_server.torch_worker.packing import pack, plan_optimizer_steps, split_into_steps
from artlike_server.trainer_ipc.steps import count_gradient_steps

from artlike.types import GRPOConfig


def padded_cost(lengths: list[int], members: list[int]) -> int:
    return len(members) * max(lengths[i] for i in members)


def test_first_fit_decreasing_worked_example() -> None:
    # longest first: 300 alone (2 × 300 > 400); 200 then 100 share a bin (2 × 200 = 400); 50 cannot join
    # either (2 × 300, 3 × 200 > 400) and opens a third
    assert pack([100, 300, 200, 50], token_budget=400) == [[1], [2, 0], [3]]


def test_similar_lengths_fill_the_budget() -> None:
    assert pack([100] * 8, token_budget=400) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_a_sequence_longer_than_the_budget_gets_its_own_micro_batch() -> None:
    assert pack([50, 1000, 40], token_budget=100) == [[1], [0, 2]]


def test_every_sequence_lands_in_exactly_one_micro_batch_within_budget() -> None:
    lengths = [(i * 37) % 230 + 5 for i in range(40)]
    bins = pack(lengths, token_budget=512)
    assert sorted(i for b in bins for i in b) == list(range(40))
    assert all(padded_cost(lengths, b) <= 512 for b in bins)


def test_budget_must_be_positive() -> None:
    with pytest.raises(ValueError):
        pack([10], token_budget=0)


def test_steps_are_balanced_by_trainable_tokens() -> None:
    # greedy, heaviest first: 5 -> A, 4 -> B, 2 -> B (6), 1 -> A (6)
    assert split_into_steps([5, 1, 4, 2], num_steps=2) == [[0, 1], [2, 3]]


def test_fewer_sequences_than_steps_gives_fewer_steps() -> None:
    assert split_into_steps([3, 7], num_steps=4) == [[1], [0]]


def test_epochs_repeat_the_same_split() -> None:
    plan = plan_optimizer_steps([5, 1, 4, 2], epochs=2, steps_per_epoch=2)
    assert plan == [[0, 1], [2, 3], [0, 1], [2, 3]]


def test_count_matches_the_plan() -> None:
    for num_sequences in (1, 2, 3, 8):
        config = GRPOConfig(epochs=3, gradient_steps_per_epoch=4)
        plan = plan_optimizer_steps([10] * num_sequences, epochs=3, steps_per_epoch=4)
        assert count_gradient_steps(num_sequences, config) == len(plan)
