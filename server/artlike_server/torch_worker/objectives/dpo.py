"""Direct preference optimisation: prefer the chosen answer over the rejected one, relative to a reference.

For a pair (chosen c, rejected r) of the same prompt, with log π(y) the summed logprob of an answer's
trainable tokens (their mean for IPO) under the policy πθ and the frozen reference π_ref:

    h     = (log πθ(c) − log π_ref(c)) − (log πθ(r) − log π_ref(r))    the implicit reward margin / β
    sigmoid  loss = −(1 − ε) · log σ(β h) − ε · log σ(−β h)                   DPO; ε > 0: conservative DPO
    robust   loss = (−(1 − ε) · log σ(β h) + ε · log σ(−β h)) / (1 − 2ε)      noise-robust DPO (Chowdhury et al.)
    hinge    loss = max(0, 1 − β h)                                          SLiC
    ipo      loss = (h − 1 / (2β))²                                          IPO (Azar et al.), mean logprobs

ε is `label_smoothing`, the assumed fraction of flipped labels. `reference_free` drops π_ref (log π_ref = 0).
A step's loss is the mean over its pairs (both answers of a pair are always in the same micro-batch).
Statistics, averaged over pairs, as TRL names them: `rewards_chosen` = β (log πθ(c) − log π_ref(c)),
`rewards_rejected` likewise, `reward_margin` = their difference, `reward_accuracy` = the fraction of pairs
whose chosen reward is strictly higher (0 at the first step, where πθ = π_ref), `logps_chosen` and
`logps_rejected` the policy's log π of the answers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F

from artlike.types import DPOConfig
from artlike_server.torch_worker.objectives.base import (
    BaseObjective,
    LossOutput,
    PolicyBatch,
    trainable_counts,
)
from artlike_server.torch_worker.objectives.tokens import behaviour_or_current, mismatch
from artlike_server.trainer_ipc.sequences import TrainSequence

LossType = Literal["sigmoid", "ipo", "hinge", "robust"]


def sequence_logps(logprobs: torch.Tensor, mask: torch.Tensor, *, mean: bool = False) -> torch.Tensor:
    """Each sequence's summed (or mean) logprob over its trainable tokens. [B, T] -> [B]"""
    mask = mask.to(logprobs.dtype)
    total = (logprobs * mask).sum(dim=1)  # [B]
    return total / mask.sum(dim=1).clamp(min=1.0) if mean else total


def preference_losses(margin: torch.Tensor, *, beta: float, loss_type: LossType,
                      label_smoothing: float = 0.0) -> torch.Tensor:
    """Each pair's loss from its margin h (see the module docstring). [P] -> [P]

    >>> preference_losses(torch.tensor([0.0]), beta=0.1, loss_type="sigmoid")  # log 2
    tensor([0.6931])
    >>> preference_losses(torch.tensor([0.0]), beta=0.5, loss_type="ipo")  # (0 - 1)²
    tensor([1.])
    """
    scaled = beta * margin  # [P]
    if loss_type == "sigmoid":
        return -(1.0 - label_smoothing) * F.logsigmoid(scaled) - label_smoothing * F.logsigmoid(-scaled)
    if loss_type == "robust":
        return (-(1.0 - label_smoothing) * F.logsigmoid(scaled) + label_smoothing * F.logsigmoid(-scaled)) / (
            1.0 - 2.0 * label_smoothing
        )
    if loss_type == "hinge":
        return torch.relu(1.0 - scaled)
    if loss_type == "ipo":
        return (margin - 1.0 / (2.0 * beta)) ** 2
    raise ValueError(f"unknown DPO loss_type {loss_type!r}")


def dpo_loss(
    logprobs: torch.Tensor,
    mask: torch.Tensor,
    pairs: torch.Tensor,
    *,
    ref_logprobs: torch.Tensor | None,
    beta: float,
    loss_type: LossType = "sigmoid",
    label_smoothing: float = 0.0,
    normalizer: float | None = None,
    behaviour_logprobs: torch.Tensor | None = None,
) -> LossOutput:
    """The DPO loss of a micro-batch of B sequences of T tokens holding P whole pairs (see the module docstring).

    `pairs[p] = (chosen row, rejected row)`; `ref_logprobs` None: reference-free. `normalizer` is the number
    of pairs in the optimizer step (by default this micro-batch's). `behaviour_logprobs` (the sampler's,
    NaN unknown) only feed the engine/trainer mismatch statistic.
    """
    mean = loss_type == "ipo"
    policy = sequence_logps(logprobs, mask, mean=mean)  # [B]
    reference = torch.zeros_like(policy) if ref_logprobs is None else sequence_logps(ref_logprobs, mask, mean=mean)
    log_ratio = policy - reference  # [B]
    chosen, rejected = pairs[:, 0], pairs[:, 1]  # [P] each
    margin = log_ratio[chosen] - log_ratio[rejected]  # [P]
    losses = preference_losses(margin, beta=beta, loss_type=loss_type, label_smoothing=label_smoothing)  # [P]
    count = torch.as_tensor(float(pairs.shape[0]), dtype=logprobs.dtype)
    norm = torch.as_tensor(pairs.shape[0] if normalizer is None else normalizer, dtype=logprobs.dtype).clamp(min=1.0)
    loss = losses.sum() / norm

    rewards_chosen = beta * log_ratio[chosen].detach()  # [P]
    rewards_rejected = beta * log_ratio[rejected].detach()  # [P]
    tokens = mask.to(logprobs.dtype).sum()
    zero = torch.zeros((), dtype=logprobs.dtype)
    mismatch_sum, mismatch_tokens = zero, zero
    if behaviour_logprobs is not None:
        behaviour, known = behaviour_or_current(logprobs, behaviour_logprobs)
        mismatch_sum, mismatch_tokens = mismatch(logprobs, behaviour, known, mask.to(logprobs.dtype))
    return LossOutput(
        loss=loss,
        policy_loss=loss.detach(),
        kl=zero,
        clipped=zero,
        tokens=tokens,
        mismatch_sum=mismatch_sum,
        mismatch_tokens=mismatch_tokens,
        metrics={
            "rewards_chosen": (rewards_chosen.sum(), count),
            "rewards_rejected": (rewards_rejected.sum(), count),
            "reward_margin": ((rewards_chosen - rewards_rejected).sum(), count),
            "reward_accuracy": ((rewards_chosen > rewards_rejected).to(logprobs.dtype).sum(), count),
            "logps_chosen": (policy[chosen].detach().sum(), count),
            "logps_rejected": (policy[rejected].detach().sum(), count),
        },
    )


class DPO(BaseObjective):
    """The DPO objective on the seam (`DPOConfig`): needs whole pairs in each micro-batch."""

    name = "dpo"

    def __init__(self, config: DPOConfig) -> None:
        self.config = config

    @property
    def needs_reference(self) -> bool:
        return not self.config.reference_free

    def normalizer(self, sequences: Sequence[TrainSequence]) -> float:
        trainable_tokens_per_sequence = trainable_counts(sequences)
        return sum(count > 0 for count in trainable_tokens_per_sequence) / 2  # the step's pairs

    def loss(self, batch: PolicyBatch, normalizer: float) -> LossOutput:
        if batch.pairs is None:
            raise ValueError("the DPO objective needs the micro-batch's pairs")
        c = self.config
        return dpo_loss(
            batch.logprobs, batch.mask, batch.pairs, ref_logprobs=batch.ref_logprobs, beta=c.beta,
            loss_type=c.loss_type, label_smoothing=c.label_smoothing, normalizer=normalizer,
            behaviour_logprobs=batch.behaviour_logprobs,
        )  # fmt: skip
