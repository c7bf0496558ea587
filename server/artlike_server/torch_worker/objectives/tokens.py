"""Token-level pieces the policy-gradient objectives share: behaviour logprobs, ratios, the KL penalty, and
how token losses are weighed into a step's loss.

Aggregation over the trainable tokens t of one optimizer step (the sum over its micro-batches):

    "token":    Σ_t loss_t / N_tokens                               every token weighs the same
    "sequence": Σ_seq (Σ_{t∈seq} loss_t / n_seq) / N_sequences      every sequence weighs the same
    "constant": Σ_t loss_t / (N_sequences · C)                     Dr. GRPO: no length bias (C: max tokens)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

Aggregation = Literal["token", "sequence", "constant"]

MAX_ABS_LOG_RATIO = 20.0
"""exp(±20) is far outside any clip range; clamping keeps exp() finite for a mis-recorded logprob."""


def behaviour_or_current(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Behaviour logprobs with unknown ones (NaN, ±inf) replaced by the current detached logprob (ratio 1),
    and the mask of known ones. Shapes [B, T]."""
    known = torch.isfinite(behaviour_logprobs)  # [B, T]
    return torch.where(known, behaviour_logprobs, logprobs.detach()), known


def log_ratio(logprobs: torch.Tensor, behaviour: torch.Tensor) -> torch.Tensor:
    """log(πθ/π_b) per token, clamped to ±MAX_ABS_LOG_RATIO. [B, T]"""
    return (logprobs - behaviour).clamp(-MAX_ABS_LOG_RATIO, MAX_ABS_LOG_RATIO)


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None) -> torch.Tensor:
    """The k3 estimator of KL(πθ ‖ π_ref) per token, ≥ 0: exp(r) − r − 1 with r = logπ_ref − logπθ. [B, T]"""
    if ref_logprobs is None:
        return torch.zeros_like(logprobs)
    diff = ref_logprobs - logprobs  # [B, T]
    return torch.exp(diff) - diff - 1.0


def token_weights(mask: torch.Tensor, aggregation: Aggregation) -> torch.Tensor:
    """Each trainable token's weight before the step's normaliser. [B, T] float"""
    if aggregation == "sequence":
        per_sequence = mask.sum(dim=1, keepdim=True)  # [B, 1]
        return mask / per_sequence.clamp(min=1.0)
    return mask


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor, aggregation: Aggregation, normalizer: float) -> torch.Tensor:
    """The step's mean entropy of the sampled tokens' distributions, aggregated as the policy loss is (so an
    `entropy_coef` weighs against it on one scale); subtracted from the loss as `entropy_coef` × this. []

    >>> entropy, mask = torch.tensor([[1.0, 3.0], [2.0, 0.0]]), torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    >>> float(entropy_bonus(entropy, mask, "token", 3)), float(entropy_bonus(entropy, mask, "sequence", 2))
    (2.0, 2.0)
    """
    weights = token_weights(mask.to(entropy.dtype), aggregation)  # [B, T]
    return (entropy * weights).sum() / max(float(normalizer), 1.0)


def step_normalizer(trainable_tokens_per_sequence: Sequence[int], aggregation: Aggregation,
                    constant: int | None = None) -> float:
    """The divisor of a step's summed weighted loss (see the module docstring).

    >>> step_normalizer([3, 0, 5], "token"), step_normalizer([3, 0, 5], "sequence")
    (8, 2)
    >>> step_normalizer([3, 0, 5], "constant", 16)
    32
    """
    sequences = sum(count > 0 for count in trainable_tokens_per_sequence)
    if aggregation == "token":
        return sum(trainable_tokens_per_sequence)
    if aggregation == "sequence":
        return sequences
    if constant is None:
        raise ValueError("aggregation 'constant' needs its constant")
    return sequences * constant


def mismatch(logprobs: torch.Tensor, behaviour: torch.Tensor, known: torch.Tensor,
             mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ |logπθ − logπ_b| over trainable tokens with a known behaviour logprob, and their count."""
    known_mask = mask * known.to(mask.dtype)  # [B, T]
    return ((logprobs.detach() - behaviour).abs() * known_mask).sum(), known_mask.sum()
