"""The objective seam: what the training loop optimises, one module per objective.

Each objective module holds a pure loss function on tensors (shapes in comments, the maths in its
docstring, worked examples in tests/unit) and an `Objective` adapter that says what the loop must hand it:
the loop computes the trainer's logprobs of every micro-batch, the reference policy's when
`needs_reference`, and calls `loss()`; it never branches on which objective runs. `build_objective` maps a
job's config (`artlike.types.TrainConfig`, a union on `objective`) to its adapter.

    objective   module     config                 loss
    grpo        grpo.py    GRPOConfig             PPO clip on token ratios (Dr. GRPO: constant normaliser)
    cispo       cispo.py   CISPOConfig            clipped, detached importance weight × REINFORCE
    gspo        gspo.py    GSPOConfig             PPO clip on the sequence-level ratio
    importance_sampling    ImportanceSamplingConfig  −ρ·A per token, unclipped (importance_sampling.py)
    sft         sft.py     SFTConfig              cross-entropy on the examples' assistant tokens
    dpo         dpo.py     DPOConfig              preference loss on pairs' log-ratios to the reference

Pair structure comes with the data, not the objective: sequences of a preference pair (`TrainSequence.preference`)
always share an optimizer step and a micro-batch, and `PolicyBatch.pairs` names their rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from artlike.types import (
    CISPOConfig,
    DPOConfig,
    GRPOConfig,
    GSPOConfig,
    ImportanceSamplingConfig,
    SFTConfig,
    TrainConfig,
)


@dataclass(frozen=True)
class PolicyBatch:
    """One micro-batch as an objective sees it: B sequences, T next-token targets each."""

    logprobs: torch.Tensor  # [B, T] the trainer's logprob of each target (carries gradient), 0 where masked
    mask: torch.Tensor  # [B, T] bool: the target is trainable
    behaviour_logprobs: torch.Tensor  # [B, T] the sampler's logprob (NaN: unknown)
    advantages: torch.Tensor  # [B]
    ref_logprobs: torch.Tensor | None = None  # [B, T] the reference policy's, when the objective needs it
    pairs: torch.Tensor | None = None  # [P, 2] long: (chosen row, rejected row) of each preference pair


@dataclass(frozen=True)
class LossOutput:
    """The loss of one micro-batch and its statistics; 0-dim tensors, only `loss` carries gradient.

    `loss`, `policy_loss` and `kl` are already divided by the optimizer step's normaliser, so their sums over
    a step's micro-batches are the step's values. Statistics are sums with their counts, so the loop can
    average them over the step: `clipped / tokens` is the clip fraction, `mismatch_sum / mismatch_tokens`
    the mean |logπθ − logπ_b|, and each `metrics[name] = (sum, count)` is averaged the same way.
    """

    loss: torch.Tensor
    policy_loss: torch.Tensor
    kl: torch.Tensor
    clipped: torch.Tensor  # trainable tokens (or tokens of sequences) whose update the clip limited
    tokens: torch.Tensor  # trainable tokens
    mismatch_sum: torch.Tensor
    mismatch_tokens: torch.Tensor  # trainable tokens with a known behaviour logprob
    metrics: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def clip_fraction(self) -> torch.Tensor:
        return self.clipped / self.tokens.clamp(min=1.0)

    @property
    def logprob_mismatch(self) -> torch.Tensor:
        return self.mismatch_sum / self.mismatch_tokens.clamp(min=1.0)


class Objective(Protocol):
    """A loss the training loop can optimise."""

    name: str

    @property
    def needs_reference(self) -> bool:
        """Whether `PolicyBatch.ref_logprobs` must be computed (the adapter disabled, no gradient)."""
        ...

    def normalizer(self, trainable_tokens_per_sequence: Sequence[int]) -> float:
        """What one optimizer step's summed loss is divided by, from its sequences' trainable token counts."""
        ...

    def loss(self, batch: PolicyBatch, normalizer: float) -> LossOutput: ...


def _builders() -> dict[type, Callable[[Any], Objective]]:
    from artlike_server.trainer.objectives.cispo import CISPO
    from artlike_server.trainer.objectives.dpo import DPO
    from artlike_server.trainer.objectives.grpo import GRPO
    from artlike_server.trainer.objectives.gspo import GSPO
    from artlike_server.trainer.objectives.importance_sampling import ImportanceSampling
    from artlike_server.trainer.objectives.sft import SFT

    return {GRPOConfig: GRPO, CISPOConfig: CISPO, GSPOConfig: GSPO, ImportanceSamplingConfig: ImportanceSampling,
            SFTConfig: SFT, DPOConfig: DPO}


def build_objective(config: TrainConfig) -> Objective:
    """The objective a job's config asks for."""
    return _builders()[type(config)](config)
