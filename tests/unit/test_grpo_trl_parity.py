"""Parity of our GRPO loss (`objectives/grpo.policy_loss`) with TRL's own `GRPOTrainer._compute_loss`.

TRL computes the loss on a trainer instance (trl/trainer/grpo_trainer.py, `_compute_loss`, TRL 1.16): the
model forward happens inside it, in `_get_per_token_logps_and_entropies`. We build the instance with
`object.__new__` (no model, no datasets), set the attributes `_compute_loss` reads, and replace only that
forward by one returning our logprob tensor, so TRL's ratio, clip, k3 KL and aggregation code run unchanged
on the same tensors as ours. Our aggregations map to TRL's `loss_type`s:

    ours        TRL         divisor of Σ token losses
    "token"     "dapo"      the trainable tokens of the whole step (`num_items_in_batch`)
    "token"     "bnpo"      the micro-batch's trainable tokens (equal with one micro-batch per step)
    "sequence"  "grpo"      per sequence its tokens, then the number of sequences
    "constant"  "dr_grpo"   sequences × max_completion_length (Dr. GRPO)

Compared in float64: loss values and gradients w.r.t. the trainer's logprobs agree to 1e-12 relative (the
two sum in different orders). One documented difference: a row with no trainable token counts as a
sequence in TRL's "grpo" and "dr_grpo" divisors and not in ours (it trains nothing, so it should not dilute
the others).
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from artlike_server.torch_worker.objectives.grpo import policy_loss
from artlike_server.torch_worker.objectives.tokens import Aggregation

with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # TRL warns that it has not been tried with this vLLM
    GRPOTrainer = pytest.importorskip("trl.trainer.grpo_trainer").GRPOTrainer  # trl: the dev extra

EPS_LOW, EPS_HIGH = 0.2, 0.28
MAX_COMPLETION = 8  # Dr. GRPO's constant: the rollouts' max_tokens
RTOL, ATOL = 1e-12, 1e-14

PAIRS: list[tuple[Aggregation, str]] = [("token", "dapo"), ("token", "bnpo"), ("sequence", "grpo"),
                                        ("constant", "dr_grpo")]


@dataclass(frozen=True)
class Batch:
    logprobs: torch.Tensor  # [B, T] the trainer's
    behaviour: torch.Tensor  # [B, T] the sampler's (TRL: old_per_token_logps)
    ref: torch.Tensor  # [B, T] the reference policy's
    advantages: torch.Tensor  # [B]
    mask: torch.Tensor  # [B, T] bool


def random_batch(seed: int = 0, rows: int = 4, length: int = MAX_COMPLETION) -> Batch:
    """Ratios spread well past both clip bounds, mixed-sign advantages, ragged lengths, every row trained."""
    g = torch.Generator().manual_seed(seed)
    logprobs = -3.0 * torch.rand(rows, length, generator=g, dtype=torch.float64) - 0.05
    behaviour = logprobs + 0.8 * (torch.rand(rows, length, generator=g, dtype=torch.float64) - 0.5)
    ref = logprobs + 0.4 * (torch.rand(rows, length, generator=g, dtype=torch.float64) - 0.5)
    advantages = torch.tensor([1.5, -0.7, 0.3, -1.2], dtype=torch.float64)[:rows]
    lengths = torch.tensor([length, 3, 5, 1])[:rows]
    mask = torch.arange(length)[None, :] < lengths[:, None]
    return Batch(logprobs, behaviour, ref, advantages, mask)


class _OneProcess:
    """accelerate's Accelerator on a single process: gather and reduce return their input."""

    num_processes = 1

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return x

    gather_for_metrics = gather

    def reduce(self, x: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return x


def trl_trainer(loss_type: str, beta: float, logprobs: torch.Tensor, accumulation: int = 1) -> Any:
    """A GRPOTrainer with just what `_compute_loss` reads; its model forward returns `logprobs`."""
    trainer: Any = object.__new__(GRPOTrainer)
    trainer.__dict__.update(
        loss_type=loss_type, beta=beta, epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH,
        importance_sampling_level="token", max_completion_length=MAX_COMPLETION,
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, use_vllm=False,
        aux_loss_enabled=False, _entropy_bonus_enabled=False,
        current_gradient_accumulation_steps=accumulation, accelerator=_OneProcess(),
        model=SimpleNamespace(training=True), _metrics={"train": defaultdict(list)},
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=accumulation),
    )  # fmt: skip
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (logprobs, torch.zeros_like(logprobs), None)
    return trainer


def trl_loss(batch: Batch, loss_type: str, beta: float, *, num_items: int | None = None,
             accumulation: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's loss on `batch` and its gradient w.r.t. the logprobs."""
    logprobs = batch.logprobs.clone().requires_grad_(True)
    rows, length = logprobs.shape
    mask = batch.mask.to(torch.int64)  # TRL's completion_mask is an integer tensor
    inputs = {
        "prompt_ids": torch.zeros(rows, 1, dtype=torch.long), "prompt_mask": torch.ones(rows, 1, dtype=torch.long),
        "completion_ids": torch.zeros(rows, length, dtype=torch.long), "completion_mask": mask,
        "advantages": batch.advantages, "old_per_token_logps": batch.behaviour, "ref_per_token_logps": batch.ref,
        "num_items_in_batch": torch.tensor(float(mask.sum()) if num_items is None else float(num_items)),
    }  # fmt: skip
    loss = trl_trainer(loss_type, beta, logprobs, accumulation)._compute_loss(None, inputs)
    loss.backward()
    assert logprobs.grad is not None
    return loss.detach(), logprobs.grad


def our_loss(batch: Batch, aggregation: Aggregation, beta: float,
             normalizer: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`policy_loss` on `batch` and its gradient w.r.t. the logprobs."""
    logprobs = batch.logprobs.clone().requires_grad_(True)
    out = policy_loss(logprobs, batch.behaviour, batch.advantages, batch.mask, epsilon_low=EPS_LOW,
                      epsilon_high=EPS_HIGH, aggregation=aggregation, ref_logprobs=batch.ref if beta else None,
                      kl_beta=beta, normalizer=normalizer, loss_normalizer=MAX_COMPLETION)  # fmt: skip
    out.loss.backward()
    assert logprobs.grad is not None
    return out.loss.detach(), logprobs.grad


def test_the_batch_exercises_both_clip_bounds() -> None:
    batch = random_batch()
    ratio = torch.exp(batch.logprobs - batch.behaviour)[batch.mask]
    assert (ratio > 1 + EPS_HIGH).any() and (ratio < 1 - EPS_LOW).any()
    assert ((ratio > 1 - EPS_LOW) & (ratio < 1 + EPS_HIGH)).any()


@pytest.mark.parametrize("beta", [0.0, 0.05])
@pytest.mark.parametrize(("aggregation", "loss_type"), PAIRS)
def test_loss_and_gradient_match_trl(aggregation: Aggregation, loss_type: str, beta: float) -> None:
    for seed in range(3):
        batch = random_batch(seed)
        ours, our_grad = our_loss(batch, aggregation, beta)
        theirs, their_grad = trl_loss(batch, loss_type, beta)
        torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(our_grad, their_grad, rtol=RTOL, atol=ATOL)
        assert our_grad.abs().sum() > 0  # not vacuously equal


def test_token_aggregation_over_micro_batches_matches_dapo() -> None:
    # One step of two micro-batches: both divide by the step's trainable tokens, so the micro-batch losses
    # and gradients add up to the same step (TRL: gradient accumulation 2, num_items_in_batch the step's).
    batch = random_batch()
    step_tokens = int(batch.mask.sum())
    halves = [Batch(*(t[rows] for t in (batch.logprobs, batch.behaviour, batch.ref, batch.advantages, batch.mask)))
              for rows in (slice(0, 2), slice(2, 4))]
    for half in halves:
        ours, our_grad = our_loss(half, "token", 0.05, normalizer=step_tokens)
        theirs, their_grad = trl_loss(half, "dapo", 0.05, num_items=step_tokens, accumulation=2)
        torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(our_grad, their_grad, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(("aggregation", "loss_type"), [("sequence", "grpo"), ("constant", "dr_grpo")])
def test_an_untrained_row_counts_as_a_sequence_in_trl_only(aggregation: Aggregation, loss_type: str) -> None:
    batch = random_batch()
    mask = batch.mask.clone()
    mask[3] = False  # 3 of the 4 rows train
    batch = Batch(batch.logprobs, batch.behaviour, batch.ref, batch.advantages, mask)
    ours, _ = our_loss(batch, aggregation, 0.0)
    theirs, _ = trl_loss(batch, loss_type, 0.0)
    torch.testing.assert_close(ours * 3, theirs * 4, rtol=RTOL, atol=ATOL)
