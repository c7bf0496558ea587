"""Importance-sampled REINFORCE: the policy gradient of off-policy samples, corrected by the token ratio, unclipped.

    ρ_t     = exp(logπθ_t - logπ_b_t)
    loss_t  = -ρ_t · A_i                      gradient -ρ_t · A_i · ∇logπθ_t
    total_t = loss_t + β · kl_t               (k3, as GRPO)

aggregated like GRPO (`tokens.py`). It is GRPO's loss without the trust region (ε = ∞; no token is ever
clipped), the `importance_sampling` loss of Tinker-style training loops: the caller bounds the update by
sampling close to the policy. Unknown behaviour logprobs count as ρ = 1 (plain REINFORCE).
"""

from __future__ import annotations

import math

import torch

from artlike.types import ImportanceSamplingConfig
from artlike_server.torch_worker.objectives.adapters import TokenLevel
from artlike_server.torch_worker.objectives.base import LossOutput, PolicyBatch
from artlike_server.torch_worker.objectives.grpo import policy_loss
from artlike_server.torch_worker.objectives.tokens import Aggregation


def importance_sampling_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    aggregation: Aggregation = "token",
    ref_logprobs: torch.Tensor | None = None,
    kl_beta: float = 0.0,
    normalizer: float | None = None,
) -> LossOutput:
    """The loss of a micro-batch of B sequences of T tokens (see the module docstring)."""
    return policy_loss(logprobs, behaviour_logprobs, advantages, mask, epsilon_low=1.0, epsilon_high=math.inf,
                       aggregation=aggregation, ref_logprobs=ref_logprobs, kl_beta=kl_beta, normalizer=normalizer)


class ImportanceSampling(TokenLevel):
    """The importance-sampling objective on the seam (`ImportanceSamplingConfig`)."""

    name = "importance_sampling"
    config: ImportanceSamplingConfig

    def loss(self, batch: PolicyBatch, normalizer: float) -> LossOutput:
        c = self.config
        out = importance_sampling_loss(
            batch.logprobs, batch.behaviour_logprobs, batch.advantages, batch.mask, aggregation=c.loss_aggregation,
            ref_logprobs=batch.ref_logprobs, kl_beta=c.kl_beta, normalizer=normalizer,
        )  # fmt: skip
        return self.with_entropy_bonus(out, batch, normalizer)
