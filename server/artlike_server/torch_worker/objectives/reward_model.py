"""Reward models: a scalar head on the decoder's pooled hidden state, trained on preferences or target scores.

A reward model (a model registered with kind "reward") is the base model + its LoRA + a linear head of
K outputs (`heads.RewardHead`): s(x) = W·pool(h(x)), one score per objective, combined as Σₖ wₖ·sₖ.

Preference pairs (chosen c, rejected r of the same prompt) train the combined score with the Bradley–Terry
model P(c ≻ r) = σ(s_c − s_r), optionally with a required `margin` m and label smoothing ε (the assumed
fraction of flipped labels):

    bt_loss = −(1 − ε) · log σ(s_c − s_r − m) − ε · log σ(−(s_c − s_r − m))

Scored examples train each objective's score toward its target with a mask of the objectives the row has
(AITraining's `compute_multi_objective_loss`):

    mse_k = Σ_rows mask·(s_k − y_k)² / Σ_rows mask          reported per objective
    regression_loss = Σ_rows,k mask·(s_k − y_k)² / Σ mask    every known target weighs the same

A step's loss is (Σ_pairs bt_loss + `regression_weight` · Σ known (s − y)² + TRL's optional
`center_rewards_coefficient` · Σ_pairs (s_c + s_r)²) / (pairs + known targets of the whole optimizer step):
every pair and every known target weighs the same, and micro-batches add up to the step. Metrics: `accuracy` (pairs with s_c > s_r), `margin`
(mean s_c − s_r), `bt_loss`, `mse` and `mse_<objective>`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from artlike.types import RewardHeadConfig, RewardModelConfig
from artlike_server.torch_worker.objectives.base import BaseObjective, LossOutput, PolicyBatch
from artlike_server.trainer_ipc.sequences import TrainSequence


def bradley_terry_losses(chosen: torch.Tensor, rejected: torch.Tensor, *, margin: float = 0.0,
                         label_smoothing: float = 0.0) -> torch.Tensor:
    """Each pair's Bradley–Terry loss from its two combined scores. [P], [P] -> [P]

    >>> bradley_terry_losses(torch.tensor([0.0]), torch.tensor([0.0]))  # log 2: no preference yet
    tensor([0.6931])
    >>> bradley_terry_losses(torch.tensor([1.0]), torch.tensor([0.0]), margin=1.0)  # the gap only meets the margin
    tensor([0.6931])
    """
    gap = chosen - rejected - margin  # [P]
    return -(1.0 - label_smoothing) * F.logsigmoid(gap) - label_smoothing * F.logsigmoid(-gap)


def masked_squared_errors(scores: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ_rows (s − y)² per objective, the count of known targets per objective); NaN targets are masked.
    [B, K], [B, K] -> [K], [K]

    >>> masked_squared_errors(torch.tensor([[1.0, 2.0]]), torch.tensor([[0.0, float("nan")]]))
    (tensor([1., 0.]), tensor([1., 0.]))
    """
    known = torch.isfinite(targets)  # [B, K]
    errors = torch.where(known, scores - torch.nan_to_num(targets), torch.zeros_like(scores)) ** 2  # [B, K]
    return errors.sum(dim=0), known.to(scores.dtype).sum(dim=0)


def combined(scores: torch.Tensor, weights: Sequence[float]) -> torch.Tensor:
    """Σₖ wₖ·sₖ per row. [B, K] -> [B]"""
    return scores @ torch.as_tensor(list(weights), dtype=scores.dtype, device=scores.device)


def reward_model_loss(
    scores: torch.Tensor,
    *,
    weights: Sequence[float],
    pairs: torch.Tensor | None,
    targets: torch.Tensor | None,
    normalizer: float,
    margin: float = 0.0,
    label_smoothing: float = 0.0,
    regression_weight: float = 1.0,
    center_rewards_coefficient: float | None = None,
    objective_names: Sequence[str] = (),
    tokens: torch.Tensor | None = None,
) -> LossOutput:
    """The reward-model loss of a micro-batch of B sequences (see the module docstring).

    `scores` [B, K] carries gradient; `pairs` [P, 2] (chosen row, rejected row); `targets` [B, K] with NaN
    where a row has no target (rows of pairs are all NaN). `normalizer`: the optimizer step's pairs plus
    known targets. `tokens`: the micro-batch's answer tokens, reported as the step's tokens (default: B)."""
    zero = scores.new_zeros(())
    norm = max(normalizer, 1.0)
    loss = zero
    metrics: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    if pairs is not None and pairs.numel():
        total = combined(scores, weights)  # [B]
        chosen, rejected = total[pairs[:, 0]], total[pairs[:, 1]]  # [P] each
        losses = bradley_terry_losses(chosen, rejected, margin=margin, label_smoothing=label_smoothing)  # [P]
        loss = loss + losses.sum() / norm
        if center_rewards_coefficient:
            loss = loss + center_rewards_coefficient * ((chosen + rejected) ** 2).sum() / norm
        count = torch.as_tensor(float(pairs.shape[0]), dtype=scores.dtype)
        metrics["bt_loss"] = (losses.detach().sum(), count)
        metrics["accuracy"] = ((chosen > rejected).to(scores.dtype).sum(), count)
        metrics["margin"] = ((chosen - rejected).detach().sum(), count)
    if targets is not None:
        squared, known = masked_squared_errors(scores, targets)  # [K] each
        if float(known.sum()) > 0:
            loss = loss + regression_weight * squared.sum() / norm
            metrics["mse"] = (squared.detach().sum(), known.sum())
            for k, name in enumerate(objective_names):
                if float(known[k]) > 0:  # an objective without a known target has no error to report (not 0)
                    metrics[f"mse_{name}"] = (squared[k].detach(), known[k])
    return LossOutput(loss=loss, policy_loss=loss.detach(), kl=zero, clipped=zero,
                      tokens=scores.new_tensor(float(scores.shape[0])) if tokens is None else tokens.to(scores.dtype),
                      mismatch_sum=zero, mismatch_tokens=zero,
                      metrics=metrics)


class RewardModel(BaseObjective):
    """The reward-model objective on the seam (`RewardModelConfig`): no logprobs, the reward head's scores."""

    name = "reward_model"
    needs_logprobs = False
    heads = frozenset({"reward"})

    def __init__(self, config: RewardModelConfig, head: RewardHeadConfig | None = None) -> None:
        self.config = config
        self.head = head or RewardHeadConfig()

    @property
    def shares_prefixes(self) -> bool:
        return self.head.pooling == "last"  # mean pooling needs every token's hidden state in the rows

    def normalizer(self, sequences: Sequence[TrainSequence]) -> float:
        pairs = sum(s.preference == 1 for s in sequences)
        return pairs + sum(math.isfinite(t) for s in sequences for t in (s.targets or ()))

    def loss(self, batch: PolicyBatch, normalizer: float) -> LossOutput:
        assert batch.scores is not None, "the loop computes the reward head's scores for this objective"
        c = self.config
        return reward_model_loss(
            batch.scores, weights=self.head.weights, pairs=batch.pairs, targets=batch.extras.get("targets"),
            normalizer=normalizer, margin=c.margin,
            label_smoothing=c.label_smoothing, regression_weight=c.regression_weight,
            center_rewards_coefficient=c.center_rewards_coefficient, objective_names=self.head.names,
            tokens=batch.mask.sum(),
        )  # fmt: skip
