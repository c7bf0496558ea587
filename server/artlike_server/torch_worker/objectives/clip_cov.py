"""Clip-Cov (Cui et al., "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models"): keep
the policy's entropy from collapsing by taking the gradient away from a few tokens that drive it down most.

Under a policy-gradient update the change of a state's entropy is about −Cov(log π(a), A(a)): a token that is
likely and rewarded, or unlikely and punished, sharpens the distribution. Per trainable token t of a
micro-batch (means over its trainable tokens, without gradient):

    cov_t = (A_t − mean A) · (logπθ_t − mean logπθ)

Among the tokens with `low < cov_t < high` that the PPO clip did not already limit, a random
`fraction` of the micro-batch's trainable tokens (at least one, when there are candidates) is chosen; their
token loss is left out of the step (no gradient), the rest train as before. The bounds skip the ordinary
tokens (covariance near 0) and the rare outliers whose update is large and informative.
"""

from __future__ import annotations

import torch


def covariance(logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each token's (A − mean A)(logπθ − mean logπθ) over the trainable tokens, without gradient; 0 where
    masked. [B, T]

    >>> logprobs = torch.tensor([[-0.1, -3.0], [-0.1, -0.2]])
    >>> covariance(logprobs, torch.tensor([-1.0, 1.0]), torch.tensor([[1.0, 1.0], [1.0, 1.0]]))
    tensor([[-0.7500,  2.1500],
            [ 0.7500,  0.6500]])
    """
    mask = mask.to(logprobs.dtype)  # [B, T]
    tokens = mask.sum().clamp(min=1.0)
    token_advantages = advantages.to(logprobs.dtype)[:, None].expand_as(logprobs)  # [B, T]
    logp = logprobs.detach()
    centred_advantages = token_advantages - (token_advantages * mask).sum() / tokens
    centred_logprobs = logp - (logp * mask).sum() / tokens
    return centred_advantages * centred_logprobs * mask


def tokens_to_exclude(logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                      already_clipped: torch.Tensor, *, fraction: float, low: float, high: float,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """The trainable tokens whose loss Clip-Cov leaves out (see the module docstring). [B, T] bool

    >>> logprobs = torch.tensor([[-0.1, -3.0], [-0.1, -0.2]])
    >>> mask, none = torch.ones(2, 2, dtype=torch.bool), torch.zeros(2, 2, dtype=torch.bool)
    >>> tokens_to_exclude(logprobs, torch.tensor([-1.0, 1.0]), mask, none, fraction=0.25, low=1.0, high=5.0)
    tensor([[False,  True],
            [False, False]])
    """
    excluded = torch.zeros_like(mask, dtype=torch.bool)
    trainable = mask.bool()
    if fraction <= 0.0 or not trainable.any():
        return excluded
    cov = covariance(logprobs, advantages, mask)  # [B, T]
    candidates = torch.nonzero(trainable & ~already_clipped & (cov > low) & (cov < high))  # [C, 2]
    if len(candidates) == 0:
        return excluded
    budget = max(1, int(fraction * int(trainable.sum())))
    chosen = candidates[torch.randperm(len(candidates), generator=generator)[:budget]]  # [≤budget, 2]
    excluded[chosen[:, 0], chosen[:, 1]] = True
    return excluded
