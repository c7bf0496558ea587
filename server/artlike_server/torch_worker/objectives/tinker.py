"""Tinker's built-in losses: token-level, each target token t with its own coefficient c_t, SUMMED over the
tokens and sequences of a pass (never averaged: the caller scales them).

    ρ_t = exp(logπθ_t − logπ_b_t)                     π_b: the sampler's (`sampling_logprobs`)
    cross_entropy        loss = −Σ c_t · logπθ_t                   c: `weights` (any sign, fractional)
    importance_sampling  loss = −Σ ρ_t · c_t                       c: `advantages` from here on
    ppo                  loss = −Σ min(ρ_t · c_t, clip(ρ_t, lo, hi) · c_t)
    cispo                loss = −Σ sg(clip(ρ_t, lo, hi)) · logπθ_t · c_t
    dro                  loss = −Σ (logπθ_t · c_t − β/2 · (logπθ_t − logπ_b_t)²)

`lo`/`hi` bound the ratio itself (Tinker's `clip_low_threshold`/`clip_high_threshold`, 0.8 and 1.2 by default).
Unknown sampling logprobs (NaN) count as the current detached logprob: ρ = 1, no dro penalty; the log-ratio is
clamped as the other objectives' (`tokens.log_ratio`). Only the targets in `mask` count (a Tinker datum's every
target). With c_t the sequence's advantage on every trainable token, importance_sampling and ppo are this
project's importance_sampling and grpo (ε = 1 − lo, hi − 1) objectives with "token" aggregation times their
normaliser, cross_entropy with c = 1 is SFT's, and cispo has the gradient of ours (its value is the surrogate
above, ours −Σ w·A) (tests/unit/test_tinker_losses.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from artlike_server.torch_worker.objectives.base import BaseObjective, LossOutput, PolicyBatch
from artlike_server.torch_worker.objectives.tokens import behaviour_or_current, log_ratio, mismatch
from artlike_server.trainer_ipc.sequences import TrainSequence
from artlike_server.trainer_ipc.tinker_loss import TinkerLossConfig, TinkerLossFn

COEFFICIENTS = "token_advantages"
"""The `PolicyBatch.extras` entry that holds c_t ([B, T], from `TrainSequence.token_advantages`)."""


def tinker_loss(
    loss_fn: TinkerLossFn,
    logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    coefficients: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low_threshold: float = 0.8,
    clip_high_threshold: float = 1.2,
    beta: float | None = None,
) -> LossOutput:
    """The summed loss of B sequences of T targets (see the module docstring); every tensor [B, T]."""
    mask = mask.to(logprobs.dtype)  # [B, T] 1.0 on the targets that count
    coefficients = coefficients.to(logprobs.dtype) * mask  # [B, T]
    behaviour, known = behaviour_or_current(logprobs, sampling_logprobs)  # [B, T]
    log_rho = log_ratio(logprobs, behaviour)  # [B, T]
    zero = torch.zeros((), dtype=logprobs.dtype)
    clipped = zero
    metrics: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    if loss_fn == "cross_entropy":
        per_token = -coefficients * logprobs
    elif loss_fn == "importance_sampling":
        per_token = -torch.exp(log_rho) * coefficients
    elif loss_fn == "ppo":
        ratio = torch.exp(log_rho)
        unclipped = ratio * coefficients
        clipped_term = ratio.clamp(clip_low_threshold, clip_high_threshold) * coefficients
        per_token = -torch.minimum(unclipped, clipped_term)
        clipped = ((unclipped > clipped_term) & (mask > 0)).sum().to(logprobs.dtype)  # min() chose the clip
    elif loss_fn == "cispo":
        ratio = torch.exp(log_rho).detach()
        weight = ratio.clamp(clip_low_threshold, clip_high_threshold)  # detached
        per_token = -weight * logprobs * coefficients
        clipped = ((weight != ratio).to(mask.dtype) * mask).sum()
        metrics["is_weight"] = ((weight * mask).sum(), mask.sum())
    elif loss_fn == "dro":
        if beta is None:
            raise ValueError("the dro loss needs beta")
        penalty = 0.5 * (logprobs - behaviour) ** 2  # [B, T] 0 where the sampling logprob is unknown
        per_token = -(logprobs * coefficients - beta * penalty)
        metrics["dro_penalty"] = ((penalty.detach() * mask).sum(), mask.sum())
    else:
        raise ValueError(f"unknown Tinker loss {loss_fn!r}")
    loss = (per_token * mask).sum()  # []
    mismatch_sum, mismatch_tokens = mismatch(logprobs, behaviour, known, mask)
    return LossOutput(
        loss=loss,
        policy_loss=loss.detach(),
        kl=zero,
        clipped=clipped,
        tokens=mask.sum(),
        mismatch_sum=mismatch_sum,
        mismatch_tokens=mismatch_tokens,
        metrics=metrics,
    )


class Tinker(BaseObjective):
    """A Tinker loss on the seam (`TinkerLossConfig`): its coefficients come per token with the sequences."""

    name = "tinker"

    def __init__(self, config: TinkerLossConfig) -> None:
        self.config = config

    @property
    def shares_prefixes(self) -> bool:
        return False  # Tinker datums are independent sequences, each trained whole

    def normalizer(self, sequences: Sequence[TrainSequence]) -> float:
        return 1.0  # Tinker's losses are sums

    def loss(self, batch: PolicyBatch, normalizer: float) -> LossOutput:
        coefficients = batch.extras.get(COEFFICIENTS)
        if coefficients is None:
            raise ValueError(f"the {self.name} loss needs per-token coefficients (extras[{COEFFICIENTS!r}])")
        c = self.config  # `normalizer` is ours, 1: the sums stand as they are
        return tinker_loss(c.loss_fn, batch.logprobs, batch.behaviour_logprobs, coefficients, batch.mask,
                           clip_low_threshold=c.clip_low_threshold, clip_high_threshold=c.clip_high_threshold,
                           beta=c.beta)  # fmt: skip
