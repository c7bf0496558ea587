"""The group-relative objectives' batch builder: each recorded trajectory's sequences carry its group's
advantage, the config's options applied (positive_advantage_weight), and tied groups are skipped."""

from __future__ import annotations

from typing import cast

import pytest
from artlike_server.training.batches import Batch, BatchContext, builder_for
from artlike_server.training.tokenizer_service import TokenizerService
from pydantic import ValidationError

from artlike.types import CISPOConfig, GRPOConfig, GSPOConfig, TrainGroup, TrainRequest, TrajectoryRef
from tests.unit.test_sequences import EOS, record


def build(config: GRPOConfig, groups: list[list[tuple[str, float]]]) -> Batch:
    request = TrainRequest(model="m", config=config, groups=[
        TrainGroup(trajectories=[TrajectoryRef(trajectory_id=t, reward=r) for t, r in group]) for group in groups])
    records = {t: [record([1, 10, 11], [20 + i, EOS]).model_copy(update={"trajectory_id": t})]
               for i, (t, _) in enumerate(p for g in groups for p in g)}
    # recorded trajectories never reach the tokenizer (only offline ones are rendered)
    context = BatchContext(tokenizer=cast(TokenizerService, None), max_sequence_tokens=64)
    return builder_for(request)(request, records, context)


@pytest.mark.parametrize("weight", [1.0, 0.1, 0.0])
def test_the_right_samples_advantage_is_weighted_and_the_wrong_ones_kept(weight: float) -> None:
    config = GRPOConfig(learning_rate=1e-4, positive_advantage_weight=weight)
    batch = build(config, [[("a", 1.0), ("b", 0.0)], [("c", 0.5), ("d", 0.5)]])  # the second group tied
    # rewards 1 and 0: mean 0.5, std 0.5, advantages ±1 (less the std's eps)
    assert [s.advantage for s in batch.sequences] == pytest.approx([weight * 0.9998, -0.9998], abs=1e-4)
    assert batch.groups_skipped == 1 and batch.rewards == [1.0, 0.0, 0.5, 0.5]


def test_the_weight_is_a_bounded_option_of_every_group_relative_objective() -> None:
    assert GRPOConfig().positive_advantage_weight == 1.0  # off by default
    assert CISPOConfig(positive_advantage_weight=0.1).positive_advantage_weight == 0.1
    assert GSPOConfig(positive_advantage_weight=0.1).positive_advantage_weight == 0.1
    with pytest.raises(ValidationError):
        GRPOConfig(positive_advantage_weight=-0.1)
