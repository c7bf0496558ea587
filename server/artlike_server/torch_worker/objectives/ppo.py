"""PPO with a value head, GAE and an adaptive KL penalty (Ziegler et al. 2019; TRL's and AITraining's PPO).

Once per job, without gradient (`PPO.prepare`), for each sequence's sampled tokens t = 1..n in order:

    kl_t   = logπ_old_t − logπ_ref_t                     π_old: the policy before this job; π_ref: the base model
    r_t    = −β·kl_t  (+ score at t = n)                 score: the trajectory's reward (+ the reward model's)
    δ_t    = r_t + γ·V_old(t+1) − V_old(t)               V_old(n+1) = 0: the episode ends
    A_t    = δ_t + γλ·A_{t+1}                            GAE; returns R_t = A_t + V_old(t)

A multi-turn sequence is one episode over its sampled tokens (tool results and user turns in between are
context, not steps). Advantages are whitened over the batch's tokens. Then, per optimizer step (several
epochs over minibatches), with ρ_t = exp(logπθ_t − logπ_b_t) against the recorded behaviour logprobs:

    policy_loss = mean_t −min(ρ_t·A_t, clip(ρ_t, 1 − ε, 1 + ε)·A_t)
    value_loss  = mean_t ½·max((V_t − R_t)², (V_old_t + clip(V_t − V_old_t, ±value_clip) − R_t)²)
    loss        = policy_loss + value_coef·value_loss − entropy_coef·mean_t H_t

β follows the adaptive controller: after each job, β ← β·(1 + clip(KL/kl_target − 1, ±0.2)·n/kl_horizon)
with KL the job's mean per-token kl_t and n its sequences; the new β is saved with the step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from artlike.types import PPOConfig
from artlike_server.torch_worker.objectives.base import (
    BaseObjective,
    JobPasses,
    LossOutput,
    PolicyBatch,
    Preparation,
)
from artlike_server.torch_worker.objectives.tokens import behaviour_or_current, k3_kl, log_ratio, mismatch
from artlike_server.trainer_ipc.sequences import TrainSequence

KL_COEF_STATE = "kl_coef"


def gae(rewards: torch.Tensor, values: torch.Tensor, *, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimates and returns of one episode of N steps ending after its last. [N] -> [N], [N]

    >>> gae(torch.tensor([0.0, 1.0]), torch.tensor([0.5, 0.5]), gamma=1.0, lam=1.0)  # Monte Carlo: 1 − V
    (tensor([0.5000, 0.5000]), tensor([1., 1.]))
    """
    advantages = torch.zeros_like(rewards)  # [N]
    running = rewards.new_zeros(())
    next_value = rewards.new_zeros(())
    for t in range(rewards.shape[0] - 1, -1, -1):
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        advantages[t] = running
        next_value = values[t]
    return advantages, advantages + values


def token_rewards(kl: torch.Tensor, score: float, kl_coef: float) -> torch.Tensor:
    """The per-step rewards of one episode: −β·kl at every step and the score at the last. [N] -> [N]

    >>> token_rewards(torch.tensor([0.5, 0.0]), 1.0, 0.1)
    tensor([-0.0500,  1.0000])
    """
    rewards = -kl_coef * kl
    rewards[-1] += score
    return rewards


def whiten(values: torch.Tensor) -> torch.Tensor:
    """(x − mean) / std over all entries (population std; unchanged spread when it is ~0). [N] -> [N]"""
    if values.numel() < 2:
        return values - values.mean()
    std = values.std(unbiased=False)
    return (values - values.mean()) / (std + 1e-8)


def adaptive_kl_coef(coef: float, kl: float, *, target: float, horizon: float, n_steps: int) -> float:
    """The adaptive KL controller's next β (Ziegler et al.): up when KL is above target, down below.

    >>> round(adaptive_kl_coef(0.1, 0.0, target=0.01, horizon=100, n_steps=10), 4)  # error clipped to −0.2
    0.098
    >>> round(adaptive_kl_coef(0.1, 0.02, target=0.01, horizon=100, n_steps=10), 4)  # +0.2
    0.102
    """
    error = min(max(kl / target - 1.0, -0.2), 0.2)
    return coef * (1.0 + error * n_steps / horizon)


def explained_variance(predicted: torch.Tensor, actual: torch.Tensor) -> float:
    """1 − Var(actual − predicted) / Var(actual): 1 perfect, 0 no better than a constant, NaN when Var = 0."""
    variance = float(actual.var(unbiased=False))
    if variance == 0.0:
        return math.nan
    return 1.0 - float((actual - predicted).var(unbiased=False)) / variance


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               clip: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped value loss and whether the clipped branch was the larger. [B, T] -> [B, T], [B, T]

    >>> value_loss(torch.tensor([[1.0]]), torch.tensor([[0.0]]), torch.tensor([[1.0]]), 0.2)  # ½·0.8²
    (tensor([[0.3200]]), tensor([[True]]))
    """
    unclipped = (values - returns) ** 2  # [B, T]
    if clip is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    clipped = (clipped_values - returns) ** 2  # [B, T]
    return 0.5 * torch.maximum(unclipped, clipped), clipped > unclipped


def ppo_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    old_values: torch.Tensor,
    *,
    clip_ratio: float,
    value_clip: float | None,
    value_coef: float,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    normalizer: float,
) -> LossOutput:
    """The PPO loss of a micro-batch of B sequences of T target positions (see the module docstring); every
    per-token input is [B, T], masked positions contribute nothing. `normalizer`: the optimizer step's
    trainable tokens. `ref_logprobs` only feed the reported KL (k3, the same estimator as GRPO's)."""
    mask_f = mask.to(logprobs.dtype)  # [B, T]
    norm = max(normalizer, 1.0)
    behaviour, known = behaviour_or_current(logprobs, behaviour_logprobs)  # [B, T] each
    ratio = torch.exp(log_ratio(logprobs, behaviour))  # [B, T]
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_ratio, 1.0 + clip_ratio) * advantages
    policy = (-torch.minimum(unclipped, clipped) * mask_f).sum() / norm  # []
    per_token_value, value_clipped = value_loss(values, old_values, returns, value_clip)  # [B, T] each
    value = (per_token_value * mask_f).sum() / norm  # []
    loss = policy + value_coef * value
    tokens = mask_f.sum()
    if entropy is not None and entropy_coef:
        loss = loss - entropy_coef * (entropy * mask_f).sum() / norm
    kl = (k3_kl(logprobs.detach(), ref_logprobs) * mask_f).sum() / norm if ref_logprobs is not None \
        else logprobs.new_zeros(())
    mismatch_sum, mismatch_tokens = mismatch(logprobs, behaviour, known, mask_f)
    return LossOutput(
        loss=loss,
        policy_loss=policy.detach(),
        kl=kl,
        clipped=((unclipped > clipped) & mask).sum().to(logprobs.dtype),
        tokens=tokens,
        mismatch_sum=mismatch_sum,
        mismatch_tokens=mismatch_tokens,
        metrics={
            "value_loss": ((per_token_value.detach() * mask_f).sum(), tokens),
            "value_clip_fraction": ((value_clipped & mask).sum().to(logprobs.dtype), tokens),
            "value_mean": ((values.detach() * mask_f).sum(), tokens),
        },
    )


def _trained_positions(sequence: TrainSequence) -> torch.Tensor:
    """The target-aligned positions (j: token j + 1) of a sequence's sampled tokens, in order. [N] long"""
    return torch.tensor([j for j, trainable in enumerate(sequence.trainable[1:]) if trainable], dtype=torch.long)


class PPO(BaseObjective):
    """PPO on the seam (`PPOConfig`): a value head, and advantages prepared once per job."""

    name = "ppo"
    heads = frozenset({"value"})

    def __init__(self, config: PPOConfig) -> None:
        self.config = config

    @property
    def entropy_gradient(self) -> bool:
        return self.config.entropy_coef > 0.0

    def normalizer(self, sequences: Sequence[TrainSequence]) -> float:
        return float(sum(sum(s.trainable[1:]) for s in sequences))

    def prepare(self, passes: JobPasses) -> Preparation:
        c = self.config
        sequences = passes.sequences
        coef = float(passes.state.get(KL_COEF_STATE, c.kl_penalty_coef))
        reference = passes.reference_logprobs()
        old_logprobs, old_values = passes.policy_outputs()
        model_scores = passes.reward_scores() if passes.reward_scores is not None else [0.0] * len(sequences)
        advantages: list[torch.Tensor] = []
        returns: list[torch.Tensor] = []
        token_advantages: list[torch.Tensor] = []
        kls: list[torch.Tensor] = []
        scores: list[float] = []
        episode_rewards: list[float] = []
        all_values: list[torch.Tensor] = []
        all_returns: list[torch.Tensor] = []
        for index, sequence in enumerate(sequences):
            positions = _trained_positions(sequence)  # [N]
            advantage = torch.zeros(max(0, sequence.num_tokens - 1))
            returned = torch.zeros_like(advantage)
            if positions.numel():
                kl = old_logprobs[index][positions] - reference[index][positions]  # [N]
                score = sequence.reward + model_scores[index]
                rewards = token_rewards(kl, score, coef)
                episode_advantages, episode_returns = gae(rewards, old_values[index][positions], gamma=c.gamma,
                                                          lam=c.lam)  # fmt: skip
                advantage[positions], returned[positions] = episode_advantages, episode_returns
                token_advantages.append(episode_advantages)
                kls.append(kl)
                scores.append(score)
                episode_rewards.append(float(rewards.sum()))
                all_values.append(old_values[index][positions])
                all_returns.append(episode_returns)
            advantages.append(advantage)
            returns.append(returned)
        if c.whiten_advantages and token_advantages:
            whitened = torch.split(whiten(torch.cat(token_advantages)), [len(a) for a in token_advantages])
            trained = (i for i, s in enumerate(sequences) if any(s.trainable[1:]))
            for index, values in zip(trained, whitened, strict=True):
                advantages[index][_trained_positions(sequences[index])] = values
        kl_mean = float(torch.cat(kls).mean()) if kls else 0.0
        next_coef = coef if not c.adaptive_kl else adaptive_kl_coef(
            coef, kl_mean, target=c.kl_target, horizon=c.kl_horizon, n_steps=len(scores))
        metrics = {
            "score_mean": sum(scores) / max(1, len(scores)),
            "reward_mean": sum(episode_rewards) / max(1, len(episode_rewards)),  # score − β·Σ kl
            "kl_old_ref": kl_mean,
            "kl_coef": coef,
            "next_kl_coef": next_coef,
        }
        if all_values:
            variance = explained_variance(torch.cat(all_values), torch.cat(all_returns))
            if math.isfinite(variance):
                metrics["explained_variance"] = variance
        return Preparation(
            extras={"advantages": advantages, "returns": returns, "old_values": old_values,
                    "ref_logprobs": reference},
            metrics=metrics,
            state={KL_COEF_STATE: next_coef},
        )

    def loss(self, batch: PolicyBatch, normalizer: float) -> LossOutput:
        assert batch.values is not None, "the loop computes the value head for this objective"
        c = self.config
        return ppo_loss(
            batch.logprobs, batch.behaviour_logprobs, batch.mask, batch.extras["advantages"],
            batch.extras["returns"], batch.values, batch.extras["old_values"], clip_ratio=c.clip_ratio,
            value_clip=c.value_clip, value_coef=c.value_coef, entropy=batch.entropy, entropy_coef=c.entropy_coef,
            ref_logprobs=batch.extras.get("ref_logprobs"), normalizer=normalizer,
        )  # fmt: skip
