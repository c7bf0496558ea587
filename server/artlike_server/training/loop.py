"""The optimizer-step loop of one training job: micro-batches, gradient accumulation, one event per step.

Pure torch on a model that is already set up (the active LoRA adapter is the one trained); the worker
process owns loading, adapters and the protocol.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from artlike.types import StepEvent, TrainConfig
from artlike_server.training.grpo import policy_loss
from artlike_server.training.logprobs import DEFAULT_CHUNK_TOKENS, token_logprobs
from artlike_server.training.packing import pack, plan_optimizer_steps
from artlike_server.training.precision import MasterWeights
from artlike_server.training.sequences import TrainSequence


class BatchError(ValueError):
    """The training batch cannot be trained on this model (empty, token ids outside the vocabulary...)."""


class NonFiniteGradient(ArithmeticError):
    """A step's gradient was NaN or infinite; the weights were not updated."""


@dataclass(frozen=True)
class MicroBatch:
    input_ids: torch.Tensor  # [B, T] long, right-padded
    mask: torch.Tensor  # [B, T-1] bool: target token t+1 is trainable
    behaviour_logprobs: torch.Tensor  # [B, T-1] float32, aligned with the targets
    advantages: torch.Tensor  # [B] float32


def collate(
    sequences: Sequence[TrainSequence], pad_token_id: int, device: torch.device | None = None
) -> MicroBatch:
    """Right-pad into tensors; per-token fields shift by one to align with next-token targets.

    The first token of a sequence has no context and is never a target, even if marked trainable.
    """
    length = max(s.num_tokens for s in sequences)
    count = len(sequences)
    input_ids = torch.full((count, length), pad_token_id, dtype=torch.long)
    mask = torch.zeros((count, length - 1), dtype=torch.bool)
    behaviour = torch.zeros((count, length - 1), dtype=torch.float32)
    for row, seq in enumerate(sequences):
        n = seq.num_tokens
        input_ids[row, :n] = torch.tensor(seq.token_ids, dtype=torch.long)
        mask[row, : n - 1] = torch.tensor(seq.trainable[1:], dtype=torch.bool)
        behaviour[row, : n - 1] = torch.tensor(seq.behaviour_logprobs[1:], dtype=torch.float32)
    advantages = torch.tensor([s.advantage for s in sequences], dtype=torch.float32)
    return MicroBatch(
        input_ids=input_ids.to(device),
        mask=mask.to(device),
        behaviour_logprobs=behaviour.to(device),
        advantages=advantages.to(device),
    )


def validate_batch(sequences: Sequence[TrainSequence], vocab_size: int) -> None:
    if not sequences:
        raise BatchError("the batch has no sequences")
    for index, seq in enumerate(sequences):
        if not (len(seq.token_ids) == len(seq.trainable) == len(seq.behaviour_logprobs)):
            raise BatchError(
                f"sequence {index}: token_ids, trainable and behaviour_logprobs differ in length"
            )
        if seq.token_ids and not 0 <= min(seq.token_ids) <= max(seq.token_ids) < vocab_size:
            raise BatchError(f"sequence {index} has token ids outside the vocabulary [0, {vocab_size})")
        if not math.isfinite(seq.advantage):
            raise BatchError(f"sequence {index} has a non-finite advantage")
    if not any(any(seq.trainable[1:]) for seq in sequences):
        raise BatchError("the batch has no trainable tokens")


@dataclass
class _StepTotals:
    policy_loss: float = 0.0
    kl: float = 0.0
    entropy_sum: float = 0.0
    clipped: float = 0.0
    tokens: int = 0
    mismatch_sum: float = 0.0
    mismatch_tokens: int = 0


def run_optimizer_steps(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    sequences: Sequence[TrainSequence],
    config: TrainConfig,
    *,
    pad_token_id: int,
    device: torch.device | None = None,
    reference: Callable[[], Any] | None = None,
    on_step: Callable[[StepEvent], None],
    on_micro_batch: Callable[[int, int, int], None] | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    master: MasterWeights | None = None,
) -> list[StepEvent]:
    """Train `epochs × gradient_steps_per_epoch` optimizer steps on `sequences`; call `on_step` after each.

    `reference()` returns a context manager under which `model` is the reference policy (the adapter
    disabled); it is used only when `config.kl_beta > 0`. `on_micro_batch(step, index, count)` reports
    progress inside a step. Each step's `logprob_mismatch` is measured on its tokens before its update: in
    the first step that is pure engine/trainer drift, later it includes the updates made so far.

    `optimizer` owns the parameters that are trained (and clipped). With `master`, those are its fp32
    copies of the model's low-precision parameters: gradients are moved into them after every micro-batch
    and the model's parameters are refreshed after every step.
    """
    optimized = [p for group in optimizer.param_groups for p in group["params"]]
    for group in optimizer.param_groups:
        group["lr"] = config.learning_rate
        group["weight_decay"] = config.weight_decay
    plan = plan_optimizer_steps(
        [sum(s.trainable[1:]) for s in sequences],
        epochs=config.epochs,
        steps_per_epoch=config.gradient_steps_per_epoch,
    )
    use_kl = config.kl_beta > 0.0
    if use_kl and reference is None:
        raise ValueError("kl_beta > 0 needs a reference policy")
    events: list[StepEvent] = []
    optimizer.zero_grad(set_to_none=True)
    if master is not None:
        master.zero_grads()  # the model's own gradients too: a job that failed mid-step may have left some
    for step_index, indices in enumerate(plan, start=1):
        started = time.perf_counter()
        step_sequences = [sequences[i] for i in indices]
        micro_batches = pack([s.num_tokens for s in step_sequences], config.micro_batch_tokens)
        trainable_counts = [sum(s.trainable[1:]) for s in step_sequences]
        normalizer = (
            sum(trainable_counts)
            if config.loss_aggregation == "token"
            else sum(c > 0 for c in trainable_counts)
        )
        totals = _StepTotals()
        for mb_index, members in enumerate(micro_batches):
            if on_micro_batch is not None:
                on_micro_batch(step_index, mb_index, len(micro_batches))
            batch = collate([step_sequences[i] for i in members], pad_token_id, device)
            if not bool(batch.mask.any()):
                continue  # nothing to train here (e.g. only the first token was marked)
            logprobs, entropy = token_logprobs(  # [B, T-1] each, 0 where not trainable
                model, batch.input_ids, mask=batch.mask, chunk_tokens=chunk_tokens
            )
            ref_logprobs = None
            if use_kl and reference is not None:
                with torch.no_grad(), reference():
                    ref_logprobs, _ = token_logprobs(
                        model, batch.input_ids, mask=batch.mask, chunk_tokens=chunk_tokens
                    )
            out = policy_loss(
                logprobs,
                batch.behaviour_logprobs,
                batch.advantages,
                batch.mask,
                epsilon_low=config.epsilon_low,
                epsilon_high=config.epsilon_high,
                aggregation=config.loss_aggregation,
                ref_logprobs=ref_logprobs,
                kl_beta=config.kl_beta,
                normalizer=normalizer,
            )
            out.loss.backward()
            if master is not None:
                master.accumulate_grads()
            tokens = int(out.tokens)
            totals.policy_loss += float(out.policy_loss)
            totals.kl += float(out.kl)
            totals.entropy_sum += float((entropy * batch.mask).sum())
            totals.clipped += float(out.clip_fraction) * tokens
            totals.tokens += tokens
            totals.mismatch_sum += float(out.logprob_mismatch) * int(out.mismatch_tokens)
            totals.mismatch_tokens += int(out.mismatch_tokens)
        max_norm = config.max_grad_norm if config.max_grad_norm is not None else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(optimized, max_norm))
        if not math.isfinite(grad_norm):
            optimizer.zero_grad(set_to_none=True)
            if master is not None:
                master.zero_grads()
            raise NonFiniteGradient(f"gradient norm is {grad_norm} at step {step_index}; weights not updated")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if master is not None:
            master.copy_to_model()
        event = StepEvent(
            gradient_step=step_index,
            num_gradient_steps=len(plan),
            loss=totals.policy_loss + config.kl_beta * totals.kl,
            policy_loss=totals.policy_loss,
            kl=totals.kl,
            entropy=totals.entropy_sum / max(1, totals.tokens),
            grad_norm=grad_norm,
            clip_fraction=totals.clipped / max(1, totals.tokens),
            learning_rate=config.learning_rate,
            tokens=totals.tokens,
            seconds=time.perf_counter() - started,
            logprob_mismatch=totals.mismatch_sum / max(1, totals.mismatch_tokens),
        )
        events.append(event)
        on_step(event)
    return events
