"""What the token-level policy-gradient objectives' seam adapters share (GRPO, CISPO, importance sampling): the
reference policy only when the KL term is on, the step normaliser of `tokens.py`, one call of their pure loss
function, and the entropy bonus (`entropy_coef` > 0: loss − entropy_coef · the aggregated entropy of the
sampled tokens' distributions, which keeps a policy from collapsing onto one answer per prompt)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from artlike.types import CISPOConfig, GRPOConfig, ImportanceSamplingConfig
from artlike_server.torch_worker.objectives.base import (
    BaseObjective,
    LossOutput,
    PolicyBatch,
    trainable_counts,
)
from artlike_server.torch_worker.objectives.tokens import entropy_bonus, step_normalizer
from artlike_server.trainer_ipc.sequences import TrainSequence


class TokenLevel(BaseObjective):
    """A token-level clipped objective: `loss_function(logprobs, behaviour, advantages, mask, *, epsilon_low,
    epsilon_high, aggregation, ref_logprobs, kl_beta, normalizer)`."""

    name: str
    loss_function: ClassVar[Callable[..., LossOutput]]

    def __init__(self, config: GRPOConfig | CISPOConfig | ImportanceSamplingConfig) -> None:
        self.config = config

    @property
    def needs_reference(self) -> bool:
        return self.config.kl_beta > 0.0

    @property
    def entropy_gradient(self) -> bool:
        return self.config.entropy_coef > 0.0

    def normalizer(self, sequences: Sequence[TrainSequence]) -> float:
        trainable_tokens_per_sequence = trainable_counts(sequences)
        return step_normalizer(trainable_tokens_per_sequence, self.config.loss_aggregation, self.config.loss_normalizer)

    def loss(self, batch: PolicyBatch, normalizer: float) -> LossOutput:
        c = self.config
        assert not isinstance(c, ImportanceSamplingConfig), "it has no clip range: ImportanceSampling.loss"
        out = type(self).loss_function(
            batch.logprobs, batch.behaviour_logprobs, batch.advantages, batch.mask,
            epsilon_low=c.epsilon_low, epsilon_high=c.epsilon_high, aggregation=c.loss_aggregation,
            ref_logprobs=batch.ref_logprobs, kl_beta=c.kl_beta, normalizer=normalizer, **self.loss_options(),
        )  # fmt: skip
        return self.with_entropy_bonus(out, batch, normalizer)

    def loss_options(self) -> dict[str, Any]:
        """Keywords only this objective's loss function takes (none here)."""
        return {}

    def with_entropy_bonus(self, out: LossOutput, batch: PolicyBatch, normalizer: float) -> LossOutput:
        """`out` with `entropy_coef` × the aggregated entropy subtracted from its loss (unchanged at 0)."""
        if not self.config.entropy_coef or batch.entropy is None:
            return out
        bonus = entropy_bonus(batch.entropy, batch.mask, self.config.loss_aggregation, normalizer)
        return dataclasses.replace(out, loss=out.loss - self.config.entropy_coef * bonus)
