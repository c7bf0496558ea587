"""Several training sessions' passes as one: their sequences share micro-batches, each row through its own
session's LoRA adapter.

Why: a pass over a few short sequences leaves the decoder's matmuls narrow, and on a CPU a wide one gets
more done per second (`bench/tinker_api.py` measures both). When several runs on the same base model wait
with a pass each, one wider pass serves them all.

How: PEFT's LoRA layers take `adapter_names`, one adapter per row (their mixed-batch forward, a public
argument of the layer's `forward`); a forward pre-hook on every LoRA layer hands it the rows' adapters for the
duration of the pass (`row_adapters`). Each session's loss is its own objective's over its own rows,
divided by its own normaliser (that of all its sequences, as in `loop.forward_backward`), and the sum of
them goes backward once: an adapter's parameters see only their own rows, so every session gets the
gradients (and logprobs) its own pass would have given, up to float rounding (tests/unit/test_fused_passes.py).

What fuses: objectives that need only the policy's logprobs (no reference pass, no heads, no preference
pairs, which must share a micro-batch) and sequences run whole (no shared-prefix families: a family's
prefix runs once for rows that may belong to different adapters). The caller checks `can_fuse`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from peft import PeftModel
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import LoraLayer
from torch import nn

from artlike_server.torch_worker.logprobs import DEFAULT_CHUNK_TOKENS, decoder_states, logprobs_from_states
from artlike_server.torch_worker.loop import PassTotals, collate, plan_step, whole_sequence_logprobs
from artlike_server.torch_worker.objectives import Objective, PolicyBatch
from artlike_server.torch_worker.precision import MasterWeights
from artlike_server.trainer_ipc.sequences import TrainSequence


@dataclass(frozen=True)
class FusedPart:
    """One session's share of a fused pass."""

    adapter_key: str  # the PEFT adapter its rows go through
    sequences: Sequence[TrainSequence]
    objective: Objective
    extras: Mapping[str, Sequence[torch.Tensor]] | None = None  # per sequence, target-aligned, as `collate`'s
    master: MasterWeights | None = None  # its fp32 copies, when the adapter is low precision


def can_fuse(objective: Objective, sequences: Sequence[TrainSequence]) -> bool:
    """Whether a pass of `objective` over `sequences` may share micro-batches with other sessions' passes."""
    return (objective.needs_logprobs and not objective.needs_reference and not objective.heads
            and not any(s.preference for s in sequences))  # fmt: skip


Block = tuple[str, int, int]
"""Rows start:end of a batch go through the adapter of this key."""


def fusable_adapter(model: nn.Module, key: str) -> bool:
    """Whether adapter `key` is plain LoRA on linear layers only, the adapters `row_adapters` applies."""
    layers = [m for m in model.modules() if isinstance(m, LoraLayer) and key in m.lora_A]
    return bool(layers) and all(isinstance(m, LoraLinear) and key not in m.lora_variant and not m.use_dora.get(key)
                                for m in layers)  # fmt: skip


@contextmanager
def row_adapters(model: PeftModel, blocks: Sequence[Block]) -> Iterator[None]:
    """Within the block, each batch the model runs goes through one adapter per block of rows (`blocks`
    covers every row, in order), each adapter's parameters requiring gradients.

    PEFT's own mixed-batch forward (`adapter_names`) gathers and scatters every sub-batch at every layer,
    which costs more than batching gains on a CPU. So the adapters are disabled (the LoRA layers compute
    their base layer) and a forward hook on each LoRA layer adds each block's B·A·dropout(x)·scaling, as
    PEFT's LoRA forward does for the active adapter: for adapters of one rank without dropout, all blocks at
    once (`_BatchedRows`: a few batched matmuls per layer, whatever the number of adapters), else block by
    block."""
    keys = [key for key, _, _ in blocks]
    batched = _BatchedRows.of(blocks)

    def add_deltas(layer: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
        assert isinstance(layer, LoraLinear)
        x = args[0]
        if batched is not None and batched.fits(layer, keys, x):
            return output + batched.deltas(layer, keys, x).to(output.dtype)
        deltas = []
        for key, start, end in blocks:
            rows = x[start:end].to(_weight(layer.lora_A[key]).dtype)
            deltas.append(layer.lora_B[key](layer.lora_A[key](layer.lora_dropout[key](rows))) * layer.scaling[key])
        return output + torch.cat(deltas).to(output.dtype)

    layers = [m for m in model.modules() if isinstance(m, LoraLinear) and set(keys) & set(m.lora_A)]
    with model.disable_adapter():  # also makes every adapter's parameters not require gradients
        for layer in layers:
            for key in set(keys) & set(layer.lora_A):
                layer.lora_A[key].requires_grad_(True)
                layer.lora_B[key].requires_grad_(True)
        handles = [layer.register_forward_hook(add_deltas) for layer in layers]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


@dataclass(frozen=True)
class _BatchedRows:
    """The blocks' rows laid out as [adapters, rows of the largest block] (shorter blocks padded with a row
    of zeros), so that every adapter's B·A·x runs as one batched matmul."""

    gather: torch.Tensor  # [n × m] long: the batch row (or B, the zero row) at each padded position
    scatter: torch.Tensor  # [B] long: each batch row's padded position
    adapters: int
    width: int  # m, rows of the largest block

    @classmethod
    def of(cls, blocks: Sequence[Block]) -> _BatchedRows | None:
        if len(blocks) < 2:
            return None
        rows = blocks[-1][2]
        width = max(end - start for _, start, end in blocks)
        gather = torch.full((len(blocks), width), rows, dtype=torch.long)
        scatter = torch.empty(rows, dtype=torch.long)
        for index, (_, start, end) in enumerate(blocks):
            gather[index, : end - start] = torch.arange(start, end)
            scatter[start:end] = index * width + torch.arange(end - start)
        return cls(gather.flatten(), scatter, len(blocks), width)

    def fits(self, layer: LoraLinear, keys: Sequence[str], x: torch.Tensor) -> bool:
        """Whether this layer's adapters can run batched: one rank, no dropout, no bias, [B, T, in] inputs."""
        if x.dim() != 3 or x.shape[0] != self.scatter.shape[0]:
            return False
        ranks = {layer.r[key] for key in keys}
        return len(ranks) == 1 and all(isinstance(layer.lora_dropout[key], nn.Identity)
                                       and layer.lora_B[key].bias is None for key in keys)  # fmt: skip

    def deltas(self, layer: LoraLinear, keys: Sequence[str], x: torch.Tensor) -> torch.Tensor:
        """[B, T, out]: each row's B·A·x·scaling, by its block's adapter."""
        down = torch.stack([_weight(layer.lora_A[key]) for key in keys])  # [n, r, in]
        up = torch.stack([_weight(layer.lora_B[key]) for key in keys])  # [n, out, r]
        scaling = torch.tensor([float(layer.scaling[key]) for key in keys], dtype=up.dtype, device=up.device)
        steps = x.shape[1]
        padded = torch.cat([x, x.new_zeros(1, *x.shape[1:])]).to(down.dtype)  # [B + 1, T, in]
        grouped = padded.index_select(0, self.gather.to(x.device)).view(self.adapters, self.width * steps, -1)
        deltas = torch.bmm(torch.bmm(grouped, down.transpose(1, 2)), up.transpose(1, 2))  # [n, m × T, out]
        deltas = deltas * scaling.view(-1, 1, 1)
        return deltas.view(self.adapters * self.width, steps, -1).index_select(0, self.scatter.to(x.device))


def fused_forward_backward(
    model: PeftModel,
    parts: Sequence[FusedPart],
    *,
    pad_token_id: int,
    token_budget: int,
    device: torch.device | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    backward: bool = True,
) -> list[PassTotals]:
    """One pass over every part's sequences (micro-batches of up to `token_budget` tokens, packed across
    parts), each part's loss divided by its objective's normaliser of its own sequences; gradients
    accumulate into each part's adapter (its `master` copies when given) unless `backward` is off. Returns
    each part's totals, with its sequences' target-aligned logprobs (`sequence_logprobs`, by index in the
    part). Afterwards the model's active adapter is as it was, and only its parameters require gradients."""
    sequences = [s for part in parts for s in part.sequences]
    owners = [p for p, part in enumerate(parts) for _ in part.sequences]
    local = [i for part in parts for i in range(len(part.sequences))]
    normalizers = [part.objective.normalizer(part.sequences) for part in parts]
    names = sorted({name for part in parts for name in (part.extras or {})})
    extras = {name: [_extra(parts[p], name, i) for p, i in zip(owners, local, strict=True)] for name in names}
    entropy_gradient = any(part.objective.entropy_gradient for part in parts)
    totals = [PassTotals() for _ in parts]
    for plan in plan_step(sequences, token_budget, share_prefixes=False):
        members = sorted(plan.members, key=owners.__getitem__)  # each part's rows together: one block each
        batch = collate([sequences[i] for i in members], pad_token_id, device,
                        extras={name: [values[i] for i in members] for name, values in extras.items()})  # fmt: skip
        spans = _spans([owners[i] for i in members])  # (part, first row, end row)
        blocks = [(parts[p].adapter_key, first, stop) for p, first, stop in spans]
        # Backward inside the block too: only there do the parts' adapter parameters require gradients.
        with torch.set_grad_enabled(backward), row_adapters(model, blocks):
            hidden = decoder_states(model, batch.input_ids)  # [B, T-1, H]
            logprobs, entropy = logprobs_from_states(model, hidden, batch.input_ids[:, 1:], mask=batch.mask,
                                                     chunk_tokens=chunk_tokens,
                                                     entropy_gradient=entropy_gradient)  # fmt: skip
            outputs = []
            for p, first, stop in spans:
                rows = slice(first, stop)
                policy = PolicyBatch(logprobs[rows], batch.mask[rows], batch.behaviour_logprobs[rows],
                                     batch.advantages[rows], entropy=entropy[rows],
                                     extras={name: value[rows] for name, value in batch.extras.items()})  # fmt: skip
                outputs.append((p, rows, parts[p].objective.loss(policy, normalizers[p])))
            if backward:
                torch.stack([out.loss for _, _, out in outputs]).sum().backward()  # type: ignore[no-untyped-call]
                for p, _, _ in outputs:
                    master = parts[p].master
                    if master is not None:
                        master.accumulate_grads()
        width = batch.input_ids.shape[1] - 1
        for p, rows, out in outputs:
            part_entropy = entropy.detach()[rows] * batch.mask[rows]
            totals[p].add(out, float(part_entropy.sum()))
            totals[p].decoder_positions += (rows.stop - rows.start) * width
            for row in range(rows.start, rows.stop):
                index = local[members[row]]
                totals[p].sequence_logprobs[index] = whole_sequence_logprobs(logprobs[row].detach(),
                                                                        parts[p].sequences[index], 0)  # fmt: skip
    return totals


def _weight(module: nn.Module) -> torch.Tensor:
    """The weight of a LoRA layer's A or B (a linear layer)."""
    assert isinstance(module, nn.Linear), module
    return module.weight


def _spans(row_owners: Sequence[int]) -> list[tuple[int, int, int]]:
    """(owner, first row, end row) of each run of equal owners.

    >>> _spans([0, 0, 2, 2, 2])
    [(0, 0, 2), (2, 2, 5)]
    """
    spans: list[tuple[int, int, int]] = []
    for row, owner in enumerate(row_owners):
        if spans and spans[-1][0] == owner:
            spans[-1] = (owner, spans[-1][1], row + 1)
        else:
            spans.append((owner, row, row + 1))
    return spans


def _extra(part: FusedPart, name: str, index: int) -> torch.Tensor:
    """The part's `name` extra of sequence `index`; zeros where its objective has none (it never reads them)."""
    if part.extras is None or name not in part.extras:
        return torch.zeros(max(0, part.sequences[index].num_tokens - 1))
    return part.extras[name][index]
