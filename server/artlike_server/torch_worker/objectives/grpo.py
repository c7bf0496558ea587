"""The GRPO objective: a clipped, importance-weighted policy-gradient loss on group-relative advantages.

Every token t the model sampled in trajectory i gets its group's advantage A_i (`training/advantages.py`).
With logπθ the trainer's logprob of that token and logπ_b the engine's logprob when it was sampled (the
behaviour policy):

    ρ_t      = exp(logπθ_t - logπ_b_t)                                    importance ratio
    loss_t   = -min(ρ_t · A_i, clip(ρ_t, 1 - ε_low, 1 + ε_high) · A_i)   PPO clip, asymmetric ("clip-higher")
    kl_t     = exp(logπ_ref_t - logπθ_t) - (logπ_ref_t - logπθ_t) - 1     k3 estimator, ≥ 0; ref = base model
    total_t  = loss_t + β · kl_t

aggregated over the step's trainable tokens as `tokens.py` says ("token", "sequence", or Dr. GRPO's
"constant"). The ratio makes the first update exactly on-policy even though vLLM and the trainer compute
slightly different numbers (bf16 kernels, batch composition), and corrects data sampled by an older
adapter. Behaviour logprobs that are unknown (NaN, e.g. offline data without logprobs; or infinite) count
as the current detached logprob: ρ = 1. With `clip_cov_fraction` > 0, Clip-Cov (`clip_cov.py`) leaves a few
tokens whose update would sharpen the policy most out of the loss, against entropy collapse.
"""

from __future__ import annotations

from typing import Any

import torch

from artlike.types import GRPOConfig
from artlike_server.torch_worker.objectives.adapters import TokenLevel
from artlike_server.torch_worker.objectives.base import LossOutput
from artlike_server.torch_worker.objectives.clip_cov import tokens_to_exclude
from artlike_server.torch_worker.objectives.tokens import (
    Aggregation,
    behaviour_or_current,
    k3_kl,
    log_ratio,
    mismatch,
    step_normalizer,
    token_weights,
)


def policy_loss(
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
    clip_cov_fraction: float = 0.0,
    clip_cov_range: tuple[float, float] = (1.0, 5.0),
    generator: torch.Generator | None = None,
) -> LossOutput:
    """The GRPO loss of a micro-batch of B sequences of T tokens (see the module docstring).

    `normalizer` is the whole optimizer step's (`tokens.step_normalizer`), so gradients accumulated over its
    micro-batches equal one big batch's; by default this micro-batch's own. Masked positions contribute
    nothing (their values may be anything finite).
    """
    mask = mask.to(logprobs.dtype)  # [B, T] 1.0 on trainable tokens
    behaviour, known = behaviour_or_current(logprobs, behaviour_logprobs)  # [B, T] each
    ratio = torch.exp(log_ratio(logprobs, behaviour))  # [B, T]
    adv = advantages.to(logprobs.dtype)[:, None]  # [B, 1]
    unclipped = ratio * adv  # [B, T]
    clipped = ratio.clamp(1.0 - epsilon_low, 1.0 + epsilon_high) * adv  # [B, T]
    per_token_policy = -torch.minimum(unclipped, clipped)  # [B, T]
    clip_limited = (unclipped > clipped) & (mask > 0)  # [B, T] min() chose the constant clip
    excluded = tokens_to_exclude(logprobs, advantages, mask, clip_limited, fraction=clip_cov_fraction,
                                 low=clip_cov_range[0], high=clip_cov_range[1], generator=generator)  # [B, T]
    per_token_policy = per_token_policy.masked_fill(excluded, 0.0)
    per_token_kl = k3_kl(logprobs, ref_logprobs)  # [B, T]

    weights = token_weights(mask, aggregation)  # [B, T]
    if normalizer is None:
        normalizer = step_normalizer([int(n) for n in mask.sum(dim=1).tolist()], aggregation, loss_normalizer)
    norm = torch.as_tensor(normalizer, dtype=logprobs.dtype).clamp(min=1.0)
    policy = (per_token_policy * weights).sum() / norm  # []
    kl = (per_token_kl * weights).sum() / norm  # []
    mismatch_sum, mismatch_tokens = mismatch(logprobs, behaviour, known, mask)
    return LossOutput(
        loss=policy + kl_beta * kl,
        policy_loss=policy.detach(),
        kl=kl.detach(),
        clipped=clip_limited.sum().to(logprobs.dtype),
        tokens=mask.sum(),
        mismatch_sum=mismatch_sum,
        mismatch_tokens=mismatch_tokens,
        metrics={"clip_cov_fraction": (excluded.sum().to(logprobs.dtype), mask.sum())} if clip_cov_fraction else {},
    )


class GRPO(TokenLevel):
    """The GRPO objective on the seam (`GRPOConfig`)."""

    name = "grpo"
    loss_function = staticmethod(policy_loss)

    def loss_options(self) -> dict[str, Any]:
        config = self.config
        assert isinstance(config, GRPOConfig)
        return {"clip_cov_fraction": config.clip_cov_fraction, "clip_cov_range": config.clip_cov_range}
