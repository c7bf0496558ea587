"""The objective seam's types: what the training loop hands an objective (`PolicyBatch`), what it answers
(`LossOutput`, `Preparation`), the `Objective` protocol and the helpers every objective shares."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from artlike_server.trainer_ipc.sequences import TrainSequence


@dataclass(frozen=True)
class PolicyBatch:
    """One micro-batch as an objective sees it: B sequences, T next-token targets each."""

    logprobs: torch.Tensor  # [B, T] the trainer's logprob of each target (carries gradient), 0 where masked
    mask: torch.Tensor  # [B, T] bool: the target is trainable
    behaviour_logprobs: torch.Tensor  # [B, T] the sampler's logprob (NaN: unknown)
    advantages: torch.Tensor  # [B]
    ref_logprobs: torch.Tensor | None = None  # [B, T] the reference policy's, when the objective needs it
    pairs: torch.Tensor | None = None  # [P, 2] long: (chosen row, rejected row) of each preference pair
    entropy: torch.Tensor | None = None  # [B, T] with gradient when the objective asks (`entropy_gradient`)
    values: torch.Tensor | None = None  # [B, T] the value head's estimate before each target ("value" head)
    scores: torch.Tensor | None = None  # [B, K] the reward head's pooled scores ("reward" head)
    extras: Mapping[str, torch.Tensor] = field(default_factory=dict)  # from `prepare`: [B, T] or [B, K] each


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


@dataclass(frozen=True)
class JobPasses:
    """What an objective's `prepare` may ask of the model once per job, before the first step, without
    gradient. Each list has one entry per sequence, target-aligned ([num_tokens − 1] float32, 0 where the
    target is not trainable) unless said otherwise."""

    sequences: Sequence[TrainSequence]
    state: Mapping[str, float]  # what the objective carried out of the step this job trains from
    reference_logprobs: Callable[[], list[torch.Tensor]]  # the reference policy's (the base model)
    policy_outputs: Callable[[], tuple[list[torch.Tensor], list[torch.Tensor]]]  # (logprobs, values) now
    reward_scores: Callable[[], list[float]] | None = None  # the configured reward model's combined scores


@dataclass(frozen=True)
class Preparation:
    extras: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # per sequence, target-aligned [num_tokens − 1]
    metrics: dict[str, float] = field(default_factory=dict)  # the job's, added to every step's metrics
    state: dict[str, float] = field(default_factory=dict)  # carried into the step this job writes


class Objective(Protocol):
    """A loss the training loop can optimise."""

    name: str
    needs_logprobs: bool  # False: the LM head is not run (a reward model)
    heads: frozenset[str]  # "value" and/or "reward": the head outputs the loop computes

    @property
    def entropy_gradient(self) -> bool:
        """Whether `PolicyBatch.entropy` must carry gradient (an entropy bonus)."""
        ...

    @property
    def needs_reference(self) -> bool:
        """Whether `PolicyBatch.ref_logprobs` must be computed (the adapter disabled, no gradient)."""
        ...

    @property
    def shares_prefixes(self) -> bool:
        """Whether sequences may be trained as prefix families (their rows then hold no prefix positions)."""
        ...

    def normalizer(self, sequences: Sequence[TrainSequence]) -> float:
        """What one optimizer step's summed loss is divided by, from its sequences."""
        ...

    def prepare(self, passes: JobPasses) -> Preparation:
        """Per-sequence tensors and job statistics computed once per job (nothing for most objectives)."""
        ...

    def loss(self, batch: PolicyBatch, normalizer: float) -> LossOutput: ...


class BaseObjective:
    """Defaults of the seam's optional parts: logprobs only, no heads, no preparation."""

    name: str
    needs_logprobs: bool = True
    heads: frozenset[str] = frozenset()

    @property
    def entropy_gradient(self) -> bool:
        return False

    @property
    def needs_reference(self) -> bool:
        return False

    @property
    def shares_prefixes(self) -> bool:
        return True

    def prepare(self, passes: JobPasses) -> Preparation:
        return Preparation()


def trainable_counts(sequences: Sequence[TrainSequence]) -> list[int]:
    """Each sequence's trainable targets (token 0 is never a target)."""
    return [sum(s.trainable[1:]) for s in sequences]
