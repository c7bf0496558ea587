"""The optimizer-step loop of one training job: micro-batches, gradient accumulation, one event per step.

Pure torch on a model that is already set up (the active LoRA adapter is the one trained); the worker
process owns loading, adapters and the protocol.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from functools import cache, partial
from typing import Any

import torch
from torch import nn

from artlike.types import GroupObjectiveConfig, StepEvent, TrainConfig
from artlike_server.torch_worker import distributed
from artlike_server.torch_worker.distributed import SINGLE, Ranks
from artlike_server.torch_worker.heads import RewardHead
from artlike_server.torch_worker.logprobs import (
    DEFAULT_CHUNK_TOKENS,
    PrefixFamilies,
    decoder_states,
    logprobs_from_states,
    supports_prefix_sharing,
)
from artlike_server.torch_worker.objectives import (
    JobPasses,
    LossOutput,
    Objective,
    PolicyBatch,
    Preparation,
    build_objective,
)
from artlike_server.torch_worker.objectives.tokens import k3_kl
from artlike_server.torch_worker.packing import (
    MicroBatchPlan,
    pack_families,
    pack_units,
    plan_micro_batches,
    plan_optimizer_steps,
)
from artlike_server.torch_worker.precision import MasterWeights
from artlike_server.torch_worker.prefixes import (
    DEFAULT_CALL_OVERHEAD,
    Family,
    common_prefix_length,
    first_needed_position,
    plan_families,
)
from artlike_server.torch_worker.schedule import learning_rate_at
from artlike_server.trainer_ipc.sequences import TrainSequence
from artlike_server.trainer_ipc.steps import units_of


class BatchError(ValueError):
    """The training batch cannot be trained on this model (empty, token ids outside the vocabulary...)."""


class NonFiniteGradient(ArithmeticError):
    """A step's gradient was NaN or infinite; the weights were not updated."""


@dataclass(frozen=True)
class MicroBatch:
    input_ids: torch.Tensor  # [B, T] long, right-padded: each row's tokens after its shared prefix
    mask: torch.Tensor  # [B, T-1] bool: target token t+1 is trainable
    behaviour_logprobs: torch.Tensor  # [B, T-1] float32, aligned with the targets
    advantages: torch.Tensor  # [B] float32
    prefixes: PrefixFamilies | None = None  # the shared prefixes the rows continue (prefixes.py)
    ref_logprobs: torch.Tensor | None = None  # [B, T-1] float32: the reference policy's, aligned with the targets
    pairs: torch.Tensor | None = None  # [P, 2] long: (chosen row, rejected row) of each preference pair
    lengths: torch.Tensor | None = None  # [B] long: each row's tokens (after the shared prefix)
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # [B, T-1] target-aligned, or "targets" [B, K]

    @property
    def decoder_positions(self) -> int:
        """Positions the decoder runs over, padding included: F × P + B × (T − 1) (F prefixes of P tokens)."""
        prefix = 0 if self.prefixes is None else self.prefixes.ids.numel()
        return prefix + self.input_ids.shape[0] * (self.input_ids.shape[1] - 1)


def collate(
    sequences: Sequence[TrainSequence],
    pad_token_id: int,
    device: torch.device | None = None,
    *,
    families: Sequence[tuple[int, int]] = (),
    reference: Sequence[torch.Tensor] | None = None,
    extras: Mapping[str, Sequence[torch.Tensor]] | None = None,
) -> MicroBatch:
    """Right-pad into tensors; per-token fields shift by one to align with next-token targets.

    The first token of a sequence has no context and is never a target, even if marked trainable.
    `families` cuts the sequences in order (`MicroBatchPlan.families`): (P, n) says the next n share their
    first P tokens, which become one of the `prefixes`, and their rows hold what follows (their targets
    start at token P + 1: nothing up to P may be trainable); sequences past the families run whole.
    `reference` holds each sequence's reference
    logprobs ([num_tokens − 1], target-aligned: `reference_logprobs`), and each of `extras` target-aligned
    tensors of an objective's `prepare` likewise. Preference pairs among the sequences
    (`TrainSequence.preference`) become `pairs`; reward-model targets become `extras["targets"]`.
    """
    starts = [0] * len(sequences)  # each sequence's shared-prefix length
    family_of = [-1] * len(sequences)
    prefix_rows: list[list[int]] = []
    row = 0
    for index, (length, count) in enumerate(families):
        members = sequences[row : row + count]
        shared = members[0].token_ids[:length]
        if any(s.token_ids[:length] != shared or any(s.trainable[1 : length + 1]) for s in members):
            raise ValueError(f"the sequences do not share {length} untrained tokens")
        prefix_rows.append(list(shared))
        for offset in range(count):
            starts[row + offset], family_of[row + offset] = length, index
        row += count
    length = max(s.num_tokens - start for s, start in zip(sequences, starts, strict=True))
    count = len(sequences)
    input_ids = torch.full((count, length), pad_token_id, dtype=torch.long)
    mask = torch.zeros((count, length - 1), dtype=torch.bool)
    behaviour = torch.zeros((count, length - 1), dtype=torch.float32)
    ref = None if reference is None else torch.zeros((count, length - 1), dtype=torch.float32)
    for row, (seq, start) in enumerate(zip(sequences, starts, strict=True)):
        n = seq.num_tokens - start
        input_ids[row, :n] = torch.tensor(seq.token_ids[start:], dtype=torch.long)
        mask[row, : n - 1] = torch.tensor(seq.trainable[start + 1 :], dtype=torch.bool)
        behaviour[row, : n - 1] = torch.tensor(seq.behaviour_logprobs[start + 1 :], dtype=torch.float32)
        if ref is not None and reference is not None:
            ref[row, : n - 1] = reference[row][start:]
    advantages = torch.tensor([s.advantage for s in sequences], dtype=torch.float32)
    prefixes = None
    if prefix_rows:
        width = max(len(ids) for ids in prefix_rows)
        prefix_ids = torch.full((len(prefix_rows), width), pad_token_id, dtype=torch.long)
        for index, ids in enumerate(prefix_rows):
            prefix_ids[index, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        prefixes = PrefixFamilies(prefix_ids.to(device), torch.tensor([len(ids) for ids in prefix_rows]).to(device),
                                  torch.tensor(family_of, dtype=torch.long).to(device))  # fmt: skip
    pairs = _pair_rows(sequences)
    collated: dict[str, torch.Tensor] = {}
    for name, values in (extras or {}).items():
        padded = torch.zeros((count, length - 1), dtype=torch.float32)
        for row, (seq, start) in enumerate(zip(sequences, starts, strict=True)):
            padded[row, : seq.num_tokens - start - 1] = values[row][start:]
        collated[name] = padded.to(device)
    width = max((len(s.targets) for s in sequences if s.targets is not None), default=0)
    if width:
        targets = torch.full((count, width), math.nan, dtype=torch.float32)
        for row, seq in enumerate(sequences):
            if seq.targets is not None:
                targets[row, : len(seq.targets)] = torch.tensor(seq.targets, dtype=torch.float32)
        collated["targets"] = targets.to(device)
    lengths = torch.tensor([s.num_tokens - start for s, start in zip(sequences, starts, strict=True)], dtype=torch.long)
    return MicroBatch(
        input_ids=input_ids.to(device),
        mask=mask.to(device),
        behaviour_logprobs=behaviour.to(device),
        advantages=advantages.to(device),
        prefixes=prefixes,
        ref_logprobs=None if ref is None else ref.to(device),
        pairs=None if pairs is None else pairs.to(device),
        lengths=lengths.to(device),
        extras=collated,
    )


def _pair_rows(sequences: Sequence[TrainSequence]) -> torch.Tensor | None:
    """[P, 2] (chosen row, rejected row) of the preference pairs among `sequences`; None when there are none."""
    sides: dict[int, dict[int, int]] = {}
    for row, seq in enumerate(sequences):
        if seq.preference:
            sides.setdefault(seq.group_index, {})[seq.preference] = row
    if not sides:
        return None
    if any(set(side) != {1, -1} for side in sides.values()):
        raise ValueError("a micro-batch holds half of a preference pair")
    return torch.tensor([[side[1], side[-1]] for side in sides.values()], dtype=torch.long)


def plan_step(sequences: Sequence[TrainSequence], token_budget: int, *, share_prefixes: bool) -> list[MicroBatchPlan]:
    """The micro-batches of one optimizer step: prefix families (when shared), the rest packed by length.

    Sequences without a trainable target are left out: they contribute nothing to the loss. Preference
    pairs are planned whole (`_plan_pairs`).
    """
    if any(s.preference for s in sequences):
        return _plan_pairs(sequences, token_budget, share_prefixes=share_prefixes)
    needed = [first_needed_position(s.trainable) for s in sequences]
    trained = [i for i, position in enumerate(needed) if position is not None]
    lengths = [sequences[i].num_tokens for i in trained]
    if share_prefixes:
        families = plan_families([sequences[i].token_ids for i in trained], [needed[i] or 0 for i in trained])
    else:
        families = [Family((index,), 0) for index in range(len(trained))]
    return [
        MicroBatchPlan(tuple(trained[i] for i in plan.members), families=plan.families)
        for plan in plan_micro_batches(lengths, families, token_budget)
    ]


def my_micro_batches(plans: Sequence[MicroBatchPlan], sequences: Sequence[TrainSequence], ranks: Ranks) -> list[int]:
    """The indices of the planned micro-batches this rank runs (`distributed.shard_micro_batches`, by the
    decoder positions each costs); all of them on a single rank."""
    if not ranks.distributed:
        return list(range(len(plans)))
    lengths = [s.num_tokens for s in sequences]
    costs = [plan.decoder_positions(lengths) for plan in plans]
    return distributed.shard_micro_batches(costs, ranks.world_size)[ranks.rank]


def _plan_pairs(sequences: Sequence[TrainSequence], token_budget: int, *, share_prefixes: bool) -> list[MicroBatchPlan]:
    """Micro-batches that hold whole preference pairs: a pair whose answers share a prompt of at least
    `DEFAULT_CALL_OVERHEAD` tokens is a prefix family of two (its prompt runs once; such pairs share
    micro-batches, `pack_families`); the other pairs are packed whole."""
    units = units_of([s.group_index for s in sequences], [s.preference for s in sequences])
    lengths = [s.num_tokens for s in sequences]
    shared: list[tuple[int, tuple[int, ...]]] = []
    packed: list[list[int]] = []
    for unit in units:
        prefix = 0
        if share_prefixes and len(unit) == 2:
            first, second = (sequences[i] for i in unit)
            needed = min(first_needed_position(first.trainable) or 0, first_needed_position(second.trainable) or 0)
            prefix = min(needed, common_prefix_length(first.token_ids, second.token_ids))
        if prefix >= DEFAULT_CALL_OVERHEAD:
            shared.append((prefix, tuple(unit)))
        else:
            packed.append(unit)
    plans = pack_families(shared, lengths, token_budget)
    plans.extend(MicroBatchPlan(tuple(members)) for members in pack_units(packed, lengths, token_budget))
    return plans


def whole_sequence_logprobs(row: torch.Tensor, sequence: TrainSequence, prefix_length: int) -> torch.Tensor:
    """One micro-batch row's logprobs as the whole sequence's, target-aligned ([num_tokens − 1], float32 on
    the CPU): the shared prefix's targets (never trainable) are 0."""
    full = torch.zeros(max(0, sequence.num_tokens - 1))
    full[prefix_length:] = row[: sequence.num_tokens - prefix_length - 1].float().cpu()
    return full


def reference_logprobs(
    model: nn.Module,
    sequences: Sequence[TrainSequence],
    reference: Callable[[], Any],
    *,
    pad_token_id: int,
    token_budget: int,
    device: torch.device | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    share_prefixes: bool = True,
    ranks: Ranks = SINGLE,
) -> list[torch.Tensor]:
    """Every sequence's reference logprobs, computed once per job without gradient under `reference()`, in
    eval mode (no adapter dropout). Each is [num_tokens − 1] float32 on the CPU, target-aligned (entry j is
    token j + 1's), 0 where the target is not trainable."""
    logprobs, _ = policy_outputs(model, sequences, reference, pad_token_id=pad_token_id, token_budget=token_budget,
                                 device=device, chunk_tokens=chunk_tokens, share_prefixes=share_prefixes,
                                 ranks=ranks)  # fmt: skip
    return logprobs


def policy_outputs(
    model: nn.Module,
    sequences: Sequence[TrainSequence],
    context: Callable[[], Any],
    *,
    pad_token_id: int,
    token_budget: int,
    value_head: nn.Module | None = None,
    device: torch.device | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    share_prefixes: bool = True,
    ranks: Ranks = SINGLE,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every sequence's logprobs and (with `value_head`) values under `context()`, without gradient, in eval
    mode (no adapter dropout). Each is [num_tokens − 1] float32 on the CPU, target-aligned (entry j is token
    j + 1's, the value of the state that predicts it), 0 where the target is not trainable. Several ranks
    split the micro-batches and exchange the results."""
    logprobs_out = [torch.zeros(max(0, s.num_tokens - 1)) for s in sequences]  # nothing trainable: stays 0
    values_out = [torch.zeros(max(0, s.num_tokens - 1)) for s in sequences]
    plans = plan_step(sequences, token_budget, share_prefixes=share_prefixes)
    computed: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}  # this rank's: index -> (logprobs, values)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), context():
            for plan in (plans[i] for i in my_micro_batches(plans, sequences, ranks)):
                batch = collate([sequences[i] for i in plan.members], pad_token_id, device,
                                families=plan.families)  # fmt: skip
                hidden = decoder_states(model, batch.input_ids, prefixes=batch.prefixes)  # [B, T-1, H]
                logprobs, _ = logprobs_from_states(model, hidden, batch.input_ids[:, 1:], mask=batch.mask,
                                                   chunk_tokens=chunk_tokens)  # fmt: skip
                values = None if value_head is None else value_head(hidden) * batch.mask  # [B, T-1]
                for row, (index, start) in enumerate(zip(plan.members, plan.prefixes(), strict=True)):
                    computed[index] = (
                        whole_sequence_logprobs(logprobs[row], sequences[index], start),
                        None if values is None else whole_sequence_logprobs(values[row], sequences[index], start),
                    )
    finally:
        model.train(was_training)
    for part in distributed.gather(ranks, computed):
        for index, (logprobs_row, values_row) in part.items():
            logprobs_out[index] = logprobs_row
            if values_row is not None:
                values_out[index] = values_row
    return logprobs_out, values_out


def score_sequences(
    model: nn.Module,
    token_ids: Sequence[Sequence[int]],
    head: RewardHead,
    *,
    pad_token_id: int,
    token_budget: int,
    device: torch.device | None = None,
) -> torch.Tensor:
    """A reward head's scores of whole token sequences, without gradient, with the model as it is (the caller
    makes it the reward model: `AdapterSlots.scorer`). Batched by `token_budget` tokens. -> [N, K] float32 CPU"""
    scores = torch.zeros((len(token_ids), head.config.num_objectives))
    order = sorted(range(len(token_ids)), key=lambda i: len(token_ids[i]))  # similar lengths pad little
    batches: list[list[int]] = [[]]
    for index in order:
        if batches[-1] and len(token_ids[index]) * (len(batches[-1]) + 1) > token_budget:
            batches.append([])
        batches[-1].append(index)
    with torch.no_grad():
        for members in batches:
            if not members:
                continue
            longest = max(len(token_ids[i]) for i in members)
            input_ids = torch.full((len(members), longest), pad_token_id, dtype=torch.long)
            for row, index in enumerate(members):
                input_ids[row, : len(token_ids[index])] = torch.tensor(list(token_ids[index]), dtype=torch.long)
            lengths = torch.tensor([len(token_ids[i]) for i in members], dtype=torch.long)
            hidden = decoder_states(model, input_ids.to(device), last=True)  # [B, T, H]
            scores[members] = head(hidden, lengths.to(device)).float().cpu()
    return scores


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
        if seq.token_advantages is not None and (len(seq.token_advantages) != len(seq.token_ids)
                                                 or not all(map(math.isfinite, seq.token_advantages))):
            raise BatchError(f"sequence {index}: token_advantages must be finite and align with token_ids")
    if not any(any(seq.trainable[1:]) for seq in sequences):
        raise BatchError("the batch has no trainable tokens")
    for unit in units_of([s.group_index for s in sequences], [s.preference for s in sequences]):
        sides = sorted(sequences[i].preference for i in unit)
        if sides[0] != 0 and (sides != [-1, 1] or not all(any(sequences[i].trainable[1:]) for i in unit)):
            raise BatchError(f"preference pair {sequences[unit[0]].group_index} needs one chosen and one rejected "
                             "sequence, each with trainable tokens")


def plan_job(sequences: Sequence[TrainSequence], config: TrainConfig) -> list[list[int]]:
    """The sequences of each optimizer step of a job (`packing.plan_optimizer_steps`; pairs stay whole)."""
    return plan_optimizer_steps(
        [sum(s.trainable[1:]) for s in sequences],
        epochs=config.epochs,
        steps_per_epoch=config.gradient_steps_per_epoch,
        units=units_of([s.group_index for s in sequences], [s.preference for s in sequences]),
    )


@dataclass
class PassTotals:
    """What one gradient pass over some sequences added up (`forward_backward`); a step is one pass."""

    loss: float = 0.0
    policy_loss: float = 0.0
    kl: float = 0.0
    entropy_sum: float = 0.0
    clipped: float = 0.0
    tokens: int = 0
    mismatch_sum: float = 0.0
    mismatch_tokens: int = 0
    decoder_positions: int = 0
    kl_to_base_sum: float = 0.0  # k3 KL to the base model over the trained tokens, when measured
    kl_to_base_tokens: int = 0
    metric_sums: dict[str, float] = field(default_factory=dict)
    metric_counts: dict[str, float] = field(default_factory=dict)
    sequence_logprobs: dict[int, torch.Tensor] = field(default_factory=dict)  # when asked: index -> [n − 1]

    def add(self, out: LossOutput, entropy_sum: float) -> None:
        self.loss += float(out.loss.detach())
        self.policy_loss += float(out.policy_loss)
        self.kl += float(out.kl)
        self.entropy_sum += entropy_sum
        self.clipped += float(out.clipped)
        self.tokens += int(out.tokens)
        self.mismatch_sum += float(out.mismatch_sum)
        self.mismatch_tokens += int(out.mismatch_tokens)
        for name, (total, count) in out.metrics.items():
            self.metric_sums[name] = self.metric_sums.get(name, 0.0) + float(total)
            self.metric_counts[name] = self.metric_counts.get(name, 0.0) + float(count)

    def metrics(self) -> dict[str, float]:
        return {name: total / max(1.0, self.metric_counts[name]) for name, total in self.metric_sums.items()}

    @classmethod
    def merged(cls, parts: Sequence[PassTotals]) -> PassTotals:
        """The totals of one pass whose micro-batches were split among ranks: every field is a sum."""
        total = cls()
        for part in parts:
            total.loss += part.loss
            total.policy_loss += part.policy_loss
            total.kl += part.kl
            total.entropy_sum += part.entropy_sum
            total.clipped += part.clipped
            total.tokens += part.tokens
            total.mismatch_sum += part.mismatch_sum
            total.mismatch_tokens += part.mismatch_tokens
            total.decoder_positions += part.decoder_positions
            total.kl_to_base_sum += part.kl_to_base_sum
            total.kl_to_base_tokens += part.kl_to_base_tokens
            for name, value in part.metric_sums.items():
                total.metric_sums[name] = total.metric_sums.get(name, 0.0) + value
            for name, value in part.metric_counts.items():
                total.metric_counts[name] = total.metric_counts.get(name, 0.0) + value
            total.sequence_logprobs.update(part.sequence_logprobs)
        return total


def forward_backward(
    model: nn.Module,
    sequences: Sequence[TrainSequence],
    objective: Objective,
    *,
    pad_token_id: int,
    token_budget: int,
    share_prefixes: bool,
    device: torch.device | None = None,
    references: Sequence[torch.Tensor] | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    master: MasterWeights | None = None,
    backward: bool = True,
    keep_logprobs: bool = False,
    on_micro_batch: Callable[[int, int], None] | None = None,
    heads: Mapping[str, nn.Module] | None = None,
    extras: Mapping[str, Sequence[torch.Tensor]] | None = None,
    base_logprobs: Sequence[torch.Tensor] | None = None,
    ranks: Ranks = SINGLE,
) -> PassTotals:
    """One pass over `sequences` as one optimizer step's worth of data: micro-batches (`plan_step`), each
    loss divided by the objective's normaliser of all of them, gradients accumulated into `.grad` (into
    `master`'s fp32 copies when given) unless `backward` is off. `references`: every sequence's reference
    logprobs (`reference_logprobs`) when the objective needs them; `heads`: the modules of the objective's
    `heads`; `extras`: its `prepare`'s per-sequence tensors. `keep_logprobs` keeps each sequence's
    target-aligned logprobs ([num_tokens − 1], 0 where not trainable) in the totals. `base_logprobs`:
    every sequence's logprobs under the base model (`reference_logprobs`), to measure the KL to it.

    Several `ranks` each run their share of the micro-batches (`my_micro_batches`) and divide by the same
    normaliser, that of all the sequences: the sum of the ranks' gradients is the one-rank pass's
    (`optimizer_step` sums them), and the totals returned are the whole pass's on every rank."""
    if objective.needs_reference and references is None:
        raise ValueError(f"the {objective.name} objective (as configured) needs reference logprobs")
    missing = objective.heads - set(heads or {})
    if missing:
        raise ValueError(f"the {objective.name} objective needs the {sorted(missing)} head(s)")
    micro_batches = plan_step(sequences, token_budget, share_prefixes=share_prefixes and objective.shares_prefixes)
    normalizer = objective.normalizer(sequences)
    totals = PassTotals()
    for index in my_micro_batches(micro_batches, sequences, ranks):
        micro_batch = micro_batches[index]
        if on_micro_batch is not None:
            on_micro_batch(index, len(micro_batches))
        members = micro_batch.members
        batch = collate([sequences[i] for i in members], pad_token_id, device,
                        families=micro_batch.families,
                        reference=None if references is None else [references[i] for i in members],
                        extras=None if extras is None else {k: [v[i] for i in members] for k, v in extras.items()})  # fmt: skip
        # A reward head reads the last token's state too: the decoder runs over all T positions of each row.
        totals.decoder_positions += batch.decoder_positions + ("reward" in objective.heads) * batch.input_ids.shape[0]
        with torch.set_grad_enabled(backward):
            policy = _forward(model, batch, objective, heads or {}, chunk_tokens)
            logprobs, entropy = policy.logprobs, policy.entropy
            out = objective.loss(policy, normalizer)
        if backward:
            out.loss.backward()  # type: ignore[no-untyped-call]
            if master is not None:
                master.accumulate_grads()
        totals.add(out, float((entropy.detach() * batch.mask).sum()) if entropy is not None else 0.0)
        if keep_logprobs:
            for row, (member, start) in enumerate(zip(members, micro_batch.prefixes(), strict=True)):
                totals.sequence_logprobs[member] = whole_sequence_logprobs(logprobs[row].detach(), sequences[member], start)
        if base_logprobs is not None:
            for row, (member, start) in enumerate(zip(members, micro_batch.prefixes(), strict=True)):
                current = whole_sequence_logprobs(logprobs[row].detach(), sequences[member], start)
                trained = torch.tensor(sequences[member].trainable[1:], dtype=torch.bool)
                # float64: exp(r) − r − 1 of a small r cancels to rounding noise in float32
                kl = k3_kl(current[trained].double(), base_logprobs[member][trained].double())
                totals.kl_to_base_sum += float(kl.sum())
                totals.kl_to_base_tokens += int(trained.sum())
    return PassTotals.merged(distributed.gather(ranks, totals)) if ranks.distributed else totals


def _forward(model: nn.Module, batch: MicroBatch, objective: Objective, heads: Mapping[str, nn.Module],
             chunk_tokens: int) -> PolicyBatch:
    """What the objective asked for of one micro-batch: logprobs and entropies (unless it needs none), the
    value head at every target position, the reward head's pooled scores."""
    hidden = decoder_states(model, batch.input_ids, prefixes=batch.prefixes,
                            last="reward" in objective.heads)  # [B, T or T-1, H]
    states = hidden[:, : batch.input_ids.shape[1] - 1]  # [B, T-1, H]: the states that predict a target
    if objective.needs_logprobs:
        logprobs, entropy = logprobs_from_states(model, states, batch.input_ids[:, 1:], mask=batch.mask,
                                                 chunk_tokens=chunk_tokens,
                                                 entropy_gradient=objective.entropy_gradient)  # fmt: skip
    else:
        logprobs, entropy = torch.zeros(batch.mask.shape, device=hidden.device), None
    # The value head reads the policy's states without sending its gradient into them: a shared trunk lets
    # the value loss move the policy's LoRA (measured: PPO on the yes/no task learned less with it).
    values = heads["value"](states.detach()) if "value" in objective.heads else None  # [B, T-1]
    scores = None
    if "reward" in objective.heads:
        assert batch.lengths is not None
        scores = heads["reward"](hidden, batch.lengths)  # [B, K]
    return PolicyBatch(logprobs, batch.mask, batch.behaviour_logprobs, batch.advantages, batch.ref_logprobs,
                       batch.pairs, entropy=entropy, values=values, scores=scores, extras=batch.extras)


def optimizer_step(optimizer: torch.optim.Optimizer, max_grad_norm: float | None,
                   master: MasterWeights | None = None, ranks: Ranks = SINGLE) -> float:
    """Clip the accumulated gradients, update, clear them; returns the gradient norm before clipping. A
    non-finite norm clears the gradients without an update and raises `NonFiniteGradient`. Several ranks
    first sum their gradients, so all of them clip and update alike."""
    optimized = [p for group in optimizer.param_groups for p in group["params"]]
    distributed.sum_gradients(ranks, optimized)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(optimized, max_grad_norm if max_grad_norm is not None else math.inf))
    if not math.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        if master is not None:
            master.zero_grads()
        raise NonFiniteGradient(f"gradient norm is {grad_norm}; weights not updated")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if master is not None:
        master.copy_to_model()
    return grad_norm


@dataclass
class JobResult:
    events: list[StepEvent]
    state: dict[str, float]  # the objective's state to save with the new step


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
    heads: Mapping[str, nn.Module] | None = None,
    objective: Objective | None = None,
    state: Mapping[str, float] | None = None,
    reward_scores: Callable[[], list[float]] | None = None,
    ranks: Ranks = SINGLE,
) -> JobResult:
    """Train `epochs × gradient_steps_per_epoch` optimizer steps on `sequences`; call `on_step` after each.

    `config` names the objective (`objectives.build_objective`, unless `objective` is given). `reference()`
    returns a context manager under which `model` is the reference policy (the adapter disabled, or a
    reference adapter active); when the objective needs it, every sequence's reference logprobs are computed
    once, before the first step (whose `seconds` include that pass), as is the objective's `prepare` (with
    `state`, carried from the step trained from, and `reward_scores`, the configured reward model's).
    `heads`: the modules of the objective's heads (trained by their own optimizer groups).
    `on_micro_batch(step, index, count)` reports progress inside a step. Each step's `logprob_mismatch` is
    measured on its tokens before its update: in the first step that is pure engine/trainer drift, later it
    includes the updates made so far.

    Sequences that share a prompt are trained as prefix families (`prefixes.py`: the prompt goes through
    the decoder once per micro-batch) unless `config.share_prefixes` is off or the model cannot keep a KV cache
    (gradient checkpointing); the result is the same up to float rounding.

    `optimizer` owns the parameters that are trained (and clipped). With `master`, those are its fp32
    copies of the model's low-precision parameters: gradients are moved into them after every micro-batch
    and the model's parameters are refreshed after every step.

    Several `ranks` (`distributed.py`) run the same job, each on its share of every step's micro-batches;
    every rank returns (and reports) the whole job's values.
    """
    for group in optimizer.param_groups:
        group["weight_decay"] = config.weight_decay
    plan = plan_job(sequences, config)
    share_prefixes = config.share_prefixes and supports_prefix_sharing(model)
    objective = objective or build_objective(config)
    job_started = time.perf_counter()  # the first step's time includes the job's reference pass
    passes = _job_passes(model, sequences, reference, heads or {}, state or {}, reward_scores,
                         pad_token_id=pad_token_id, token_budget=config.micro_batch_tokens, device=device,
                         chunk_tokens=chunk_tokens, share_prefixes=share_prefixes, ranks=ranks)  # fmt: skip
    references: list[torch.Tensor] | None = None
    if objective.needs_reference:
        if reference is None:
            raise ValueError(f"the {objective.name} objective (as configured) needs a reference policy")
        references = passes.reference_logprobs()
    # The reference of the rewarded-group objectives is the base model: with a KL penalty its pass is
    # already done, otherwise it is one more forward pass without gradient, run when the config asks.
    base_logprobs = passes.reference_logprobs() if reference is not None and measures_kl_to_base(config) else None
    preparation: Preparation = objective.prepare(passes)
    events: list[StepEvent] = []
    optimizer.zero_grad(set_to_none=True)
    if master is not None:
        master.zero_grads()  # the model's own gradients too: a job that failed mid-step may have left some
    for step_index, indices in enumerate(plan, start=1):
        started = job_started if step_index == 1 else time.perf_counter()
        learning_rate = learning_rate_at(step_index, len(plan), config.learning_rate, schedule=config.lr_schedule,
                                         warmup_steps=config.warmup_steps)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate
        totals = forward_backward(
            model, [sequences[i] for i in indices], objective, pad_token_id=pad_token_id,
            token_budget=config.micro_batch_tokens, share_prefixes=share_prefixes, device=device,
            references=None if references is None else [references[i] for i in indices],
            chunk_tokens=chunk_tokens, master=master,
            on_micro_batch=None if on_micro_batch is None else partial(on_micro_batch, step_index),
            heads=heads, extras={k: [v[i] for i in indices] for k, v in preparation.extras.items()},
            base_logprobs=None if base_logprobs is None else [base_logprobs[i] for i in indices], ranks=ranks,
        )  # fmt: skip
        try:
            grad_norm = optimizer_step(optimizer, config.max_grad_norm, master, ranks)
        except NonFiniteGradient as error:
            raise NonFiniteGradient(f"{error} at step {step_index}") from None
        event = StepEvent(
            gradient_step=step_index,
            num_gradient_steps=len(plan),
            loss=totals.loss,
            policy_loss=totals.policy_loss,
            kl=totals.kl,
            entropy=totals.entropy_sum / max(1, totals.tokens),
            grad_norm=grad_norm,
            clip_fraction=totals.clipped / max(1, totals.tokens),
            learning_rate=learning_rate,
            tokens=totals.tokens,
            seconds=time.perf_counter() - started,
            logprob_mismatch=totals.mismatch_sum / max(1, totals.mismatch_tokens),
            decoder_positions=totals.decoder_positions,
            kl_to_base=totals.kl_to_base_sum / max(1, totals.kl_to_base_tokens) if base_logprobs is not None else None,
            objective=objective.name,
            metrics={**preparation.metrics, **totals.metrics()},
        )
        events.append(event)
        on_step(event)
    return JobResult(events, {**(state or {}), **preparation.state})


def measures_kl_to_base(config: TrainConfig) -> bool:
    """Whether a job reports its steps' KL to the base model: the rewarded-group objectives do with a KL
    penalty (its reference pass is the base model's) or when `measure_kl_to_base` asks."""
    if not isinstance(config, GroupObjectiveConfig):
        return False
    return config.kl_beta > 0.0 or config.measure_kl_to_base


def _job_passes(
    model: nn.Module,
    sequences: Sequence[TrainSequence],
    reference: Callable[[], Any] | None,
    heads: Mapping[str, nn.Module],
    state: Mapping[str, float],
    reward_scores: Callable[[], list[float]] | None,
    **options: Any,
) -> JobPasses:
    """The once-per-job passes an objective may ask for; each runs when asked (and at most once)."""
    @cache
    def reference_pass() -> list[torch.Tensor]:
        if reference is None:
            raise ValueError("this job has no reference policy")
        return reference_logprobs(model, sequences, reference, **options)

    @cache
    def policy_pass() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return policy_outputs(model, sequences, _unchanged, value_head=heads.get("value"), **options)

    return JobPasses(sequences=sequences, state=state, reference_logprobs=reference_pass,
                     policy_outputs=policy_pass, reward_scores=reward_scores)


def _unchanged() -> AbstractContextManager[None]:
    """The model as it is (the trained adapter active)."""
    return nullcontext()
