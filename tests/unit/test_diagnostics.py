"""The group and sample statistics a rewarded-group job reports (training/diagnostics.py), worked by hand."""

from __future__ import annotations

import math

import pytest
from artlike_server.training.diagnostics import group_statistics, sample_statistics
from pydantic import ValidationError

from artlike.types import GRPOConfig


def test_groups_split_into_all_wrong_mixed_and_all_right_by_the_threshold() -> None:
    # [1, 0.1]: one passes (mixed, has variance); [0.1, 0.1]: none pass, zero variance;
    # [1, 1]: both pass, zero variance; [0.4, 0.2]: none pass at 0.5 but the rewards differ.
    stats = group_statistics([[1.0, 0.1], [0.1, 0.1], [1.0, 1.0], [0.4, 0.2]], pass_threshold=0.5)
    assert (stats.groups, stats.zero_variance, stats.all_wrong, stats.mixed, stats.all_right) == (4, 2, 2, 1, 1)
    assert stats.zero_variance_fraction == 0.5
    assert stats.pass_rate == pytest.approx(3 / 8)


def test_a_reward_equal_to_the_threshold_passes() -> None:
    stats = group_statistics([[0.5, 0.5, 0.5]], pass_threshold=0.5)
    assert (stats.all_right, stats.all_wrong, stats.mixed, stats.pass_rate) == (1, 0, 0, 1.0)


def test_groups_with_an_unknown_reward_are_not_counted() -> None:
    stats = group_statistics([[None, 1.0], [0.0, 1.0], []], pass_threshold=0.5)
    assert (stats.groups, stats.mixed, stats.zero_variance) == (1, 1, 0)
    empty = group_statistics([[None]], pass_threshold=0.5)
    assert empty.groups == 0 and empty.zero_variance_fraction is None and empty.pass_rate is None


def test_sample_statistics_average_length_per_trajectory_and_surprise_per_token() -> None:
    # 2 + 4 tokens over 2 trajectories; the NaN logprob (unknown) is left out: (0.5 + 1.5 + 3 × 1.0) / 5 = 1.0
    stats = sample_statistics([[-0.5, -1.5], [-1.0, -1.0, -1.0, math.nan]])
    assert stats.response_tokens_mean == 3.0
    assert stats.sampling_entropy == pytest.approx(1.0)
    assert sample_statistics([]).response_tokens_mean is None
    assert sample_statistics([[], [math.inf]]).sampling_entropy is None


def test_the_pass_threshold_is_a_finite_config_field() -> None:
    assert GRPOConfig().pass_threshold == 0.5 and not GRPOConfig().measure_kl_to_base
    with pytest.raises(ValidationError):
        GRPOConfig(pass_threshold=math.nan)
