"""The GRPO objective: a clipped, importance-weighted policy-gradient loss on group-relative advantages.

Every token t the model sampled in trajectory i gets its group's advantage A_i (`advantages.py`). With logπθ the trainer's logprob of
that token and logπ_b the engine's logprob when it was sampled (the behaviour policy):

    ρ_t      = exp(logπθ_t - logπ_b_t)                                    importance ratio
    loss_t   = -min(ρ_t · A_i, clip(ρ_t, 1 - ε_low, 1 + ε_high) · A_i)   PPO clip, asymmetric ("clip-higher")
    kl_t     = exp(logπ_ref_t - logπθ_t) - (logπ_ref_t - logπθ_t) - 1     k3 estimator, ≥ 0; ref = base model
    total_t  = loss_t + β · kl_t

Aggregation over the trainable tokens of one optimizer step (the sum over its micro-batches):

    "token":    Σ_t total_t / N_tokens                                    every token weighs the same
    "sequence": Σ_seq (Σ_{t∈seq} total_t / n_seq) / N_sequences           every sequence weighs the same

The ratio makes the first update exactly on-policy even though vLLM and the trainer compute slightly different
numbers (bf16 kernels, batch composition), and corrects data sampled by an older adapter. Behaviour logprobs
that are unknown (NaN, e.g. offline data without logprobs; or infinite) count as the current detached
logprob: ρ = 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Aggregation = Literal["token", "sequence"]

_MAX_ABS_LOG_RATIO = 20.0
"""exp(±20) is far outside any clip range; clamping keeps exp() finite for a mis-recorded logprob."""


@dataclass(frozen=True)
class LossOutput:
    """The loss of one micro-batch and its statistics; all 0-dim tensors, only `loss` carries gradient.

    `loss`, `policy_loss` and `kl` are divided by the optimizer step's normaliser, so summing them over the
    step's micro-batches gives the step's values; the fractions are over this call's tokens.
    """

    loss: torch.Tensor  # policy_loss + β·kl: backward() this
    policy_loss: torch.Tensor  # detached
    kl: torch.Tensor  # detached
    clip_fraction: torch.Tensor  # share of trainable tokens whose gradient the clip cut
    logprob_mismatch: torch.Tensor  # mean |logπθ - logπ_b| over tokens with a known behaviour logprob
    tokens: torch.Tensor  # trainable tokens
    mismatch_tokens: torch.Tensor  # trainable tokens with a known behaviour logprob


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
) -> LossOutput:
    """The GRPO loss of a micro-batch of B sequences of T tokens (see the module docstring).

    `normalizer` is the number of trainable tokens ("token") or of sequences ("sequence") in the whole
    optimizer step, so gradients accumulated over its micro-batches equal one big batch's; by default this
    micro-batch's own count. Masked positions contribute nothing (their values may be anything finite).
    """
    mask = mask.to(logprobs.dtype)  # [B, T] 1.0 on trainable tokens
    known = torch.isfinite(behaviour_logprobs)  # [B, T] NaN: not recorded; ±inf: nothing usable either
    behaviour = torch.where(known, behaviour_logprobs, logprobs.detach())  # [B, T]
    log_ratio = (logprobs - behaviour).clamp(-_MAX_ABS_LOG_RATIO, _MAX_ABS_LOG_RATIO)  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    adv = advantages.to(logprobs.dtype)[:, None]  # [B, 1]
    unclipped = ratio * adv  # [B, T]
    clipped = ratio.clamp(1.0 - epsilon_low, 1.0 + epsilon_high) * adv  # [B, T]
    per_token_policy = -torch.minimum(unclipped, clipped)  # [B, T]
    if ref_logprobs is not None:
        ref_diff = ref_logprobs - logprobs  # [B, T]
        per_token_kl = torch.exp(ref_diff) - ref_diff - 1.0  # [B, T]
    else:
        per_token_kl = torch.zeros_like(logprobs)  # [B, T]

    if aggregation == "token":
        weights = mask  # [B, T]
        default_normalizer = mask.sum()
    else:  # "sequence": each sequence's tokens share weight 1
        seq_tokens = mask.sum(dim=1, keepdim=True)  # [B, 1]
        weights = mask / seq_tokens.clamp(min=1.0)  # [B, T]
        default_normalizer = (seq_tokens > 0).sum()
    norm = torch.as_tensor(normalizer if normalizer is not None else default_normalizer, dtype=logprobs.dtype)
    norm = norm.clamp(min=1.0)
    policy = (per_token_policy * weights).sum() / norm  # []
    kl = (per_token_kl * weights).sum() / norm  # []

    tokens = mask.sum()  # []
    cut = ((unclipped > clipped) & (mask > 0)).to(logprobs.dtype)  # [B, T] min() chose the constant clip
    known_mask = mask * known.to(logprobs.dtype)  # [B, T]
    mismatch_tokens = known_mask.sum()  # []
    abs_diff = (logprobs.detach() - behaviour).abs() * known_mask  # [B, T]
    return LossOutput(
        loss=policy + kl_beta * kl,
        policy_loss=policy.detach(),
        kl=kl.detach(),
        clip_fraction=cut.sum() / tokens.clamp(min=1.0),
        logprob_mismatch=abs_diff.sum() / mismatch_tokens.clamp(min=1.0),
        tokens=tokens,
        mismatch_tokens=mismatch_tokens,
    )
