"""The GSPO objective (Qwen, 2025): the PPO clip on a sequence-level importance ratio.

A sequence's reward belongs to the whole sequence, so GSPO weighs whole sequences: with n_i the trainable
tokens of sequence i,

    s_i     = exp( (1/n_i) Σ_t (logπθ_t - logπ_b_t) )                 geometric mean of the token ratios
    loss_i  = -min(s_i · A_i, clip(s_i, 1 - ε_low, 1 + ε_high) · A_i)   ε ~ 3e-4..4e-4: s_i stays near 1
    kl_i    = (1/n_i) Σ_t kl_t                                         (k3, as GRPO)
    step    = Σ_i (loss_i + β · kl_i) / N_sequences

Unknown behaviour logprobs count as ratio 1 (as GRPO). `clip_fraction` is the share of tokens in sequences
whose ratio the clip cut; `metrics.sequence_ratio` is the mean s_i.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from artlike.types import GSPOConfig
from artlike_server.torch_worker.objectives.base import (
    BaseObjective,
    LossOutput,
    PolicyBatch,
    trainable_counts,
)
from artlike_server.torch_worker.objectives.tokens import (
    behaviour_or_current,
    k3_kl,
    log_ratio,
    mismatch,
    step_normalizer,
)
from artlike_server.trainer_ipc.sequences import TrainSequence


def gspo_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon_low: float,
    epsilon_high: float,
    ref_logprobs: torch.Tensor | None = None,
    kl_beta: float = 0.0,
    normalizer: float | None = None,
) -> LossOutput:
    """The GSPO loss of a micro-batch of B sequences of T tokens (see the module docstring)."""
    mask = mask.to(logprobs.dtype)  # [B, T]
    behaviour, known = behaviour_or_current(logprobs, behaviour_logprobs)  # [B, T]
    lengths = mask.sum(dim=1)  # [B]
    trained = (lengths > 0).to(mask.dtype)  # [B]
    mean_log_ratio = (log_ratio(logprobs, behaviour) * mask).sum(dim=1) / lengths.clamp(min=1.0)  # [B]
    ratio = torch.exp(mean_log_ratio)  # [B]
    adv = advantages.to(logprobs.dtype)  # [B]
    unclipped = ratio * adv  # [B]
    clipped = ratio.clamp(1.0 - epsilon_low, 1.0 + epsilon_high) * adv  # [B]
    per_sequence_policy = -torch.minimum(unclipped, clipped) * trained  # [B]
    per_sequence_kl = (k3_kl(logprobs, ref_logprobs) * mask).sum(dim=1) / lengths.clamp(min=1.0)  # [B]

    if normalizer is None:
        normalizer = float(trained.sum())
    norm = torch.as_tensor(normalizer, dtype=logprobs.dtype).clamp(min=1.0)
    policy = per_sequence_policy.sum() / norm  # []
    kl = per_sequence_kl.sum() / norm  # []
    mismatch_sum, mismatch_tokens = mismatch(logprobs, behaviour, known, mask)
    cut = (unclipped > clipped).to(mask.dtype) * trained  # [B]
    return LossOutput(
        loss=policy + kl_beta * kl,
        policy_loss=policy.detach(),
        kl=kl.detach(),
        clipped=(cut * lengths).sum(),
        tokens=lengths.sum(),
        mismatch_sum=mismatch_sum,
        mismatch_tokens=mismatch_tokens,
        metrics={"sequence_ratio": ((ratio.detach() * trained).sum(), trained.sum())},
    )


class GSPO(BaseObjective):
    """The GSPO objective on the seam (`GSPOConfig`)."""

    name = "gspo"

    def __init__(self, config: GSPOConfig) -> None:
        self.config = config

    @property
    def needs_reference(self) -> bool:
        return self.config.kl_beta > 0.0

    def normalizer(self, sequences: Sequence[TrainSequence]) -> float:
        trainable_tokens_per_sequence = trainable_counts(sequences)
        return step_normalizer(trainable_tokens_per_sequence, "sequence")

    def loss(self, batch: PolicyBatch, normalizer: float) -> LossOutput:
        c = self.config
        return gspo_loss(
            batch.logprobs, batch.behaviour_logprobs, batch.advantages, batch.mask,
            epsilon_low=c.epsilon_low, epsilon_high=c.epsilon_high, ref_logprobs=batch.ref_logprobs,
            kl_beta=c.kl_beta, normalizer=normalizer,
        )  # fmt: skip
