"""Supervised fine-tuning: the mean negative log-likelihood of the examples' assistant tokens.

    loss = -Σ_t logπθ_t / N_tokens           over the trainable (assistant) tokens of the optimizer step

Only the tokens the examples mark trainable count (prompts, tool results and user turns are context); the
normaliser is the whole step's trainable tokens, so micro-batches add up to one big batch. `metrics.nll` is
the step's mean NLL per token (its exp is the perplexity).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from artlike.types import SFTConfig
from artlike_server.torch_worker.objectives.base import (
    BaseObjective,
    LossOutput,
    PolicyBatch,
    trainable_counts,
)
from artlike_server.trainer_ipc.sequences import TrainSequence


def cross_entropy_loss(logprobs: torch.Tensor, mask: torch.Tensor, *, normalizer: float | None = None) -> LossOutput:
    """The SFT loss of a micro-batch of B sequences of T tokens (see the module docstring)."""
    mask = mask.to(logprobs.dtype)  # [B, T]
    tokens = mask.sum()  # []
    norm = torch.as_tensor(tokens if normalizer is None else normalizer, dtype=logprobs.dtype).clamp(min=1.0)
    nll_sum = -(logprobs * mask).sum()  # []
    loss = nll_sum / norm
    zero = torch.zeros((), dtype=logprobs.dtype)
    return LossOutput(
        loss=loss,
        policy_loss=loss.detach(),
        kl=zero,
        clipped=zero,
        tokens=tokens,
        mismatch_sum=zero,
        mismatch_tokens=zero,
        metrics={"nll": (nll_sum.detach(), tokens)},
    )


class SFT(BaseObjective):
    """The SFT objective on the seam (`SFTConfig`)."""

    name = "sft"

    def __init__(self, config: SFTConfig) -> None:
        self.config = config

    @property
    def needs_reference(self) -> bool:
        return False

    def normalizer(self, sequences: Sequence[TrainSequence]) -> float:
        trainable_tokens_per_sequence = trainable_counts(sequences)
        return sum(trainable_tokens_per_sequence)

    def loss(self, batch: PolicyBatch, normalizer: float) -> LossOutput:
        return cross_entropy_loss(batch.logprobs, batch.mask, normalizer=normalizer)
