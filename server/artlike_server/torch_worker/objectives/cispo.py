"""The CISPO objective (MiniMax-M1, 2025): REINFORCE weighted by a clipped, detached importance weight.

GRPO's clip zeroes the gradient of every token whose ratio left the trust region, and the tokens it drops
are often rare, decisive ones ("However", "Wait"). CISPO clips the weight instead, so every sampled token
keeps a gradient:

    ρ_t     = exp(logπθ_t - logπ_b_t)
    w_t     = sg(clip(ρ_t, 1 - ε_low, 1 + ε_high))        ε_low = 1: no lower bound (the paper's setting)
    loss_t  = -w_t · A_i · exp(logπθ_t - sg(logπθ_t))    value -w_t·A_i, gradient -w_t·A_i·∇logπθ_t
    total_t = loss_t + β · kl_t                           (k3, as GRPO)

aggregated like GRPO (`tokens.py`). `clip_fraction` is the share of tokens whose weight was clipped; the
step's `metrics.is_weight` is the mean clipped weight.
"""

from __future__ import annotations

import torch

from artlike_server.torch_worker.objectives.adapters import TokenLevel
from artlike_server.torch_worker.objectives.base import LossOutput
from artlike_server.torch_worker.objectives.tokens import (
    Aggregation,
    behaviour_or_current,
    k3_kl,
    log_ratio,
    mismatch,
    step_normalizer,
    token_weights,
)


def cispo_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon_low: float,
    epsilon_high: float,
    aggregation: Aggregation = "token",
    ref_logprobs: torch.Tensor | None = None,
    kl_beta: float = 0.0,
    normalizer: float | None = None,
    loss_normalizer: int | None = None,
) -> LossOutput:
    """The CISPO loss of a micro-batch of B sequences of T tokens (see the module docstring)."""
    mask = mask.to(logprobs.dtype)  # [B, T]
    behaviour, known = behaviour_or_current(logprobs, behaviour_logprobs)  # [B, T]
    ratio = torch.exp(log_ratio(logprobs, behaviour)).detach()  # [B, T]
    weight = ratio.clamp(1.0 - epsilon_low, 1.0 + epsilon_high)  # [B, T] detached
    adv = advantages.to(logprobs.dtype)[:, None]  # [B, 1]
    score = torch.exp(logprobs - logprobs.detach())  # [B, T] value 1, gradient ∇logπθ
    per_token_policy = -weight * adv * score  # [B, T]
    per_token_kl = k3_kl(logprobs, ref_logprobs)  # [B, T]

    weights = token_weights(mask, aggregation)  # [B, T]
    if normalizer is None:
        normalizer = step_normalizer([int(n) for n in mask.sum(dim=1).tolist()], aggregation, loss_normalizer)
    norm = torch.as_tensor(normalizer, dtype=logprobs.dtype).clamp(min=1.0)
    policy = (per_token_policy * weights).sum() / norm  # []
    kl = (per_token_kl * weights).sum() / norm  # []
    mismatch_sum, mismatch_tokens = mismatch(logprobs, behaviour, known, mask)
    tokens = mask.sum()
    return LossOutput(
        loss=policy + kl_beta * kl,
        policy_loss=policy.detach(),
        kl=kl.detach(),
        clipped=((weight != ratio).to(mask.dtype) * mask).sum(),
        tokens=tokens,
        mismatch_sum=mismatch_sum,
        mismatch_tokens=mismatch_tokens,
        metrics={"is_weight": ((weight * mask).sum(), tokens)},
    )


class CISPO(TokenLevel):
    """The CISPO objective on the seam (`CISPOConfig`)."""

    name = "cispo"
    loss_function = staticmethod(cispo_loss)
