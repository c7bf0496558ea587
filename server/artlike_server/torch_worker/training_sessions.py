"""Training sessions in the worker: forward/backward passes, optimizer steps and checkpoints on demand.

A session is a model's adapter slot (`adapters.py`) whose gradients outlive a command: `pass` adds to them
(micro-batched exactly as a `/_train_model` step: `loop.forward_backward`; sequences that carry per-token
coefficients hand them to the objective, which Tinker's losses need), `optim_step` applies and clears
them (`loop.optimizer_step`), `save_state` writes the adapter with the AdamW state beside it
(`optimizer.pt`), which `session_open` reads back. Between a session's commands the worker may run other
models' jobs: each command makes its model's adapter the active one again, and other adapters' steps never
touch this one's gradients. `passes` runs several models' passes at once, as one pass where their objectives
allow (`fused_passes.py`), each answered as if it had run alone.

With several ranks (`distributed.py`) every rank runs every session command: a pass splits its micro-batches
among them (each rank keeps its own part of the gradients), `optim_step` sums the gradients first, and only
rank 0 writes `save_state`'s files (the worker sees to that).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from artlike.session_types import AdamParams
from artlike_server.torch_worker.adapters import OPTIMIZER_FILE, AdapterError, AdapterSlots
from artlike_server.torch_worker.distributed import SINGLE, Ranks
from artlike_server.torch_worker.fused_passes import (
    FusedPart,
    can_fuse,
    fusable_adapter,
    fused_forward_backward,
)
from artlike_server.torch_worker.logprobs import supports_prefix_sharing
from artlike_server.torch_worker.loop import (
    BatchError,
    PassTotals,
    forward_backward,
    optimizer_step,
    plan_step,
    reference_logprobs,
    validate_batch,
)
from artlike_server.torch_worker.objectives import Objective, build_objective
from artlike_server.torch_worker.objectives.tinker import COEFFICIENTS
from artlike_server.trainer_ipc import protocol
from artlike_server.trainer_ipc.batch_file import read_batch
from artlike_server.trainer_ipc.sequences import TrainSequence
from artlike_server.trainer_ipc.tinker_loss import TinkerLossConfig

logger = logging.getLogger("artlike.trainer")


class SessionError(RuntimeError):
    """A session command for a model that has no open session."""


class Sessions:
    def __init__(self, adapters: AdapterSlots, *, pad_token_id: int, vocab_size: int, device: torch.device,
                 ranks: Ranks = SINGLE) -> None:
        self._adapters = adapters
        self._ranks = ranks
        self._pad_token_id = pad_token_id
        self._vocab_size = vocab_size
        self._device = device
        self._open: set[str] = set()

    def is_open(self, model_name: str) -> bool:
        return model_name in self._open

    def open(self, command: protocol.SessionOpen) -> protocol.SessionReady:
        adapter_dir = Path(command.adapter_dir)
        slot = self._adapters.load(command.model_name, adapter_dir)
        state = "reused"
        if command.fresh_optimizer:
            slot.drop_optimizer()
        if slot.optimizer is None:
            optimizer = slot.start_optimizer(self._adapters.parameters(command.model_name),
                                             learning_rate=command.optimizer.learning_rate,
                                             weight_decay=command.optimizer.weight_decay)  # fmt: skip
            state = "fresh"
            saved = adapter_dir / OPTIMIZER_FILE
            if saved.is_file() and not command.fresh_optimizer:
                try:
                    optimizer.load_state_dict(torch.load(saved, map_location=self._device, weights_only=True))
                except (ValueError, KeyError, RuntimeError) as error:
                    raise AdapterError(f"{saved} does not fit this adapter: {error}") from None
                state = "loaded"
        self._zero_grads(command.model_name)
        self._open.add(command.model_name)
        return protocol.SessionReady(id=command.id, optimizer_state=state)

    def run_pass(self, command: protocol.Pass) -> protocol.PassDone:
        return self._run_alone(self._prepare(command), time.perf_counter())

    def _run_alone(self, prepared: _Prepared, started: float) -> protocol.PassDone:
        command = prepared.command
        self._adapters.activate(command.model_name)
        model = self._adapters.model
        slot = self._adapters.slot(command.model_name)
        share_prefixes = command.config.share_prefixes and supports_prefix_sharing(model)
        references = None
        if prepared.objective.needs_reference:
            reference = self._adapters.reference_policy(
                command.model_name,
                None if command.reference_adapter_dir is None else Path(command.reference_adapter_dir))
            references = reference_logprobs(model, prepared.sequences, reference, pad_token_id=self._pad_token_id,
                                            token_budget=command.config.micro_batch_tokens, device=self._device,
                                            share_prefixes=share_prefixes, ranks=self._ranks)  # fmt: skip
        model.train()
        try:
            totals = forward_backward(
                model, prepared.sequences, prepared.objective, pad_token_id=self._pad_token_id,
                token_budget=command.config.micro_batch_tokens, share_prefixes=share_prefixes, device=self._device,
                references=references, master=slot.master if command.backward else None,
                backward=command.backward, keep_logprobs=True, extras=prepared.extras, ranks=self._ranks,
            )  # fmt: skip
        finally:
            model.eval()
        return _pass_done(prepared, totals, time.perf_counter() - started)

    def run_passes(self, command: protocol.Passes) -> protocol.PassesDone:
        """Each pass's answer, as if it had run alone; passes that may share micro-batches (`can_fuse`, the same
        `backward` and micro-batch budget, one rank) run as one fused pass."""
        results: dict[int, protocol.PassDone | protocol.Failed] = {}
        groups: dict[tuple[bool, int], list[_Prepared]] = {}
        alone: list[_Prepared] = []
        for sub in command.passes:
            try:
                prepared = self._prepare(sub)
            except Exception as error:  # reported in its place, as a pass of its own would be
                logger.exception("pass %s failed", sub.id)
                results[sub.id] = _failed(sub, error)
                continue
            if (self._ranks.distributed or not can_fuse(prepared.objective, prepared.sequences)
                    or self._shares_prefixes(prepared)
                    or not fusable_adapter(self._adapters.model, self._adapters.slot(sub.model_name).key)):
                alone.append(prepared)
            else:
                groups.setdefault((sub.backward, sub.config.micro_batch_tokens), []).append(prepared)
        for group in groups.values():
            if len(group) == 1:
                alone.extend(group)
                continue
            try:
                results.update((p.command.id, done) for p, done in zip(group, self._fused(group), strict=True))
            except Exception as error:
                logger.exception("a fused pass failed")
                results.update((p.command.id, _failed(p.command, error)) for p in group)
        for prepared in alone:
            try:
                results[prepared.command.id] = self._run_alone(prepared, time.perf_counter())
            except Exception as error:
                logger.exception("pass %s failed", prepared.command.id)
                results[prepared.command.id] = _failed(prepared.command, error)
        return protocol.PassesDone(id=command.id, results=[results[sub.id] for sub in command.passes])

    def _fused(self, group: list[_Prepared]) -> list[protocol.PassDone]:
        started = time.perf_counter()
        model = self._adapters.model
        parts = []
        for prepared in group:
            slot = self._adapters.slot(prepared.command.model_name)
            parts.append(FusedPart(slot.key, prepared.sequences, prepared.objective, prepared.extras,
                                   slot.master if prepared.command.backward else None))
        first = group[0].command
        model.train()
        try:
            totals = fused_forward_backward(model, parts, pad_token_id=self._pad_token_id,
                                            token_budget=first.config.micro_batch_tokens, device=self._device,
                                            backward=first.backward)  # fmt: skip
        finally:
            model.eval()
        seconds = time.perf_counter() - started
        return [_pass_done(prepared, part, seconds, fused=len(group)) for prepared, part in zip(group, totals,
                                                                                                strict=True)]

    def _shares_prefixes(self, prepared: _Prepared) -> bool:
        """Whether the pass alone would run shared prompts once (prefix families): a fused pass runs every
        sequence whole, which would cost more than it gains."""
        config = prepared.command.config
        if not (config.share_prefixes and prepared.objective.shares_prefixes
                and supports_prefix_sharing(self._adapters.model)):  # fmt: skip
            return False
        return any(plan.families for plan in plan_step(prepared.sequences, config.micro_batch_tokens,
                                                        share_prefixes=True))  # fmt: skip

    def _prepare(self, command: protocol.Pass) -> _Prepared:
        self._require(command.model_name)
        sequences = read_batch(Path(command.batch_path))
        validate_batch(sequences, self._vocab_size)
        return _Prepared(command, sequences, build_objective(command.config),
                         _token_coefficients(sequences, command.config))

    def optim_step(self, command: protocol.OptimStep) -> protocol.Optimized:
        started = time.perf_counter()
        self._require(command.model_name)
        slot = self._adapters.slot(command.model_name)
        assert slot.optimizer is not None, "a session's slot has an optimizer from session_open"
        _set_hyperparameters(slot.optimizer, command.optimizer)
        grad_norm = optimizer_step(slot.optimizer, command.optimizer.max_grad_norm, slot.master, self._ranks)
        return protocol.Optimized(id=command.id, grad_norm=grad_norm, seconds=time.perf_counter() - started)

    def save(self, command: protocol.SaveState) -> protocol.Saved:
        started = time.perf_counter()
        self._require(command.model_name)
        path = self._adapters.save(command.model_name, Path(command.out_dir), with_optimizer=True)
        return protocol.Saved(id=command.id, path=str(path), seconds=time.perf_counter() - started)

    def close(self, command: protocol.SessionClose) -> protocol.Closed:
        if command.model_name in self._open:
            self._zero_grads(command.model_name)
            self._open.discard(command.model_name)
        return protocol.Closed(id=command.id)

    def _require(self, model_name: str) -> None:
        if model_name not in self._open:
            raise SessionError(f"no training session is open on {model_name!r} in this trainer")

    def _zero_grads(self, model_name: str) -> None:
        slot = self._adapters.slot(model_name)
        for parameter in self._adapters.parameters(model_name):
            parameter.grad = None
        if slot.master is not None:
            slot.master.zero_grads()
        if slot.optimizer is not None:
            slot.optimizer.zero_grad(set_to_none=True)


@dataclass(frozen=True)
class _Prepared:
    """A pass whose batch was read and checked."""

    command: protocol.Pass
    sequences: list[TrainSequence]
    objective: Objective
    extras: dict[str, list[torch.Tensor]] | None


def _pass_done(prepared: _Prepared, totals: PassTotals, seconds: float, *, fused: int = 1) -> protocol.PassDone:
    logprobs: list[list[float | None]] = []
    for index, sequence in enumerate(prepared.sequences):
        values = totals.sequence_logprobs.get(index)  # absent: nothing trainable in it
        scored: list[float | None] = [None]  # the first token has no context
        scored.extend(float(values[t - 1]) if values is not None and sequence.trainable[t] else None
                      for t in range(1, sequence.num_tokens))
        logprobs.append(scored)
    tokens = max(1, totals.tokens)
    metrics = {"policy_loss": totals.policy_loss, "kl": totals.kl, "entropy": totals.entropy_sum / tokens,
               "clip_fraction": totals.clipped / tokens,
               "logprob_mismatch": totals.mismatch_sum / max(1, totals.mismatch_tokens), **totals.metrics()}
    return protocol.PassDone(id=prepared.command.id, loss=totals.loss, tokens=totals.tokens,
                             objective=prepared.objective.name, metrics=metrics, logprobs=logprobs, seconds=seconds,
                             fused=fused)


def _failed(command: protocol.Pass, error: Exception) -> protocol.Failed:
    return protocol.Failed(id=command.id, kind=type(error).__name__, message=str(error) or repr(error))


def _token_coefficients(sequences: list[TrainSequence], config: protocol.PassConfig
                        ) -> dict[str, list[torch.Tensor]] | None:
    """The sequences' per-token coefficients as the objective's extras (target-aligned [num_tokens − 1]) when
    every one carries them; a Tinker loss cannot do without them."""
    coefficients = []
    for index, sequence in enumerate(sequences):
        if sequence.token_advantages is None:
            if isinstance(config, TinkerLossConfig):
                raise BatchError(f"sequence {index} has no token_advantages, which the {config.loss_fn} loss needs")
            return None
        coefficients.append(torch.tensor(sequence.token_advantages[1:], dtype=torch.float32))
    return {COEFFICIENTS: coefficients}


def _set_hyperparameters(optimizer: torch.optim.Optimizer, params: AdamParams) -> None:
    """AdamW reads these from its param groups at every step."""
    for group in optimizer.param_groups:
        group["lr"] = params.learning_rate
        group["betas"] = params.betas
        group["eps"] = params.eps
        group["weight_decay"] = params.weight_decay
