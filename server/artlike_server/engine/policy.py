"""Policy engines: the model being trained, served from merged weights instead of a LoRA adapter.

A LoRA engine serves every step of every model (`name@N` adapters beside the base model), but each
adapter costs extra matmuls: on CPU the current policy decodes faster from merged weights
(`bench/lora_serving.py` measures by how much). A policy engine is a vLLM engine without LoRA whose
weights follow one step, the training policy: whenever a model's alias moves (a committed step, a
rollback), `follow` makes that step the target and each policy engine

1. leaves the policy rotation (`holds` = None): the step's requests go to the LoRA engines meanwhile;
2. checks from headers that the adapter can be merged (`merge_check`), else keeps serving the base model;
3. pauses (in-flight requests finish), folds the adapter into its weights (`artlike_merge` backend,
   `merge_transfer.py`), drops its prefix cache and resumes;
4. verifies: the prompt logprobs of a fixed text from the merged weights must match a LoRA engine's for
   the same step (mean |Δ| ≤ `tolerance`), else it goes back to the base weights;
5. holds the step: requests for it (`name` while the alias points there, or `name@N`) go to it first.

Only requests for exactly the held step (or the base model while it holds the base) are sent to it, so
a policy engine never serves a wrong step; if it fails, requests fail over to the LoRA engines.
Restarts come back with base weights and resync. The decisions are here; the pool routes (`pool.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from ..errors import APIError, NotFound
from .client import EngineRequestError
from .merge_check import UnsupportedAdapter, check_mergeable
from .routing import Phase, least_loaded

logger = logging.getLogger(__name__)

# A fixed, ordinary text: its prompt logprobs under the merged weights and under the LoRA adapter are
# compared after each merge.
PROBE_TEXT = ("The committee met on Tuesday to review the budget. After a long discussion about travel costs, "
              "they agreed to postpone the new office until spring and to ask each team for a shorter plan.")
# Mean |Δ logprob| over the probe allowed between merged weights and the LoRA engine. Half precision rounds
# the merged weights (and the LoRA path's own sums), so bf16 gets the looser bound (bench/policy_engine.py
# and tests/integration/test_policy_engine.py measure the difference).
HALF_PRECISION_TOLERANCE = 0.1
FULL_PRECISION_TOLERANCE = 0.01
DEFAULT_TOLERANCE = HALF_PRECISION_TOLERANCE


def probe_tolerance(dtype: str) -> float:
    """The verification tolerance for an engine running `dtype` ("float32" → 0.01; bf16/fp16/auto → 0.1)."""
    return FULL_PRECISION_TOLERANCE if dtype in ("float32", "float") else HALF_PRECISION_TOLERANCE

DRAIN_POLL_S = 0.05
ReferenceLogprobs = Callable[[str, list[int], int], Awaitable[list[float]]]


class ProbeMismatch(RuntimeError):
    """The merged weights do not reproduce the LoRA engine's logprobs for the same step."""


@dataclass(frozen=True)
class PolicyTarget:
    name: str  # the engine model name whose weights to hold: "name@N", or the base model id
    adapter_path: str | None  # None: the base model's own weights


@dataclass(eq=False)
class PolicySlot:
    """One policy engine and what its weights are."""

    member: Any  # an EngineMember (pool.py); typed loosely to keep this module free of the pool
    holds: str | None = None  # the engine model name its weights equal; None: unknown or changing
    syncs: int = 0
    last_sync_s: float | None = None
    probe_diff: float | None = None  # mean |Δ logprob| of the last verification
    refused: dict[str, str] = field(default_factory=dict)  # target name → why it is not merged (not retried)
    task: asyncio.Task[None] | None = None

    def describe(self) -> dict[str, Any]:
        return {**self.member.describe(), "holds": self.holds, "syncs": self.syncs,
                "last_sync_s": self.last_sync_s, "probe_diff": self.probe_diff,
                "refused": dict(self.refused)}


class PolicyEngines:
    def __init__(self, members: Sequence[Any], *, base_model_id: str, model_dir: Path,
                 reference: ReferenceLogprobs, tolerance: float = DEFAULT_TOLERANCE,
                 model: str | None = None, drain_timeout_s: float = 600.0) -> None:
        """`reference(model, token_ids, start)` gives a LoRA engine's logprobs (the pool's `token_logprobs`);
        `model` pins the policy to one model's steps (default: whichever model's alias moved last)."""
        self.slots = [PolicySlot(member) for member in members]
        self.base_model_id = base_model_id
        self.model_dir = model_dir
        self.reference = reference
        self.tolerance = tolerance
        self.model = model
        self.drain_timeout_s = drain_timeout_s
        self.target = PolicyTarget(base_model_id, None)
        self._probe: list[int] | None = None
        for slot in self.slots:
            slot.member.runner.add_on_ready(self._on_ready(slot))

    @property
    def members(self) -> list[Any]:
        return [slot.member for slot in self.slots]

    def describe(self) -> list[dict[str, Any]]:
        return [slot.describe() for slot in self.slots]

    # --------------------------------------------------------------------------------- routing

    def pick(self, model: str, *, exclude: set[str]) -> Any | None:
        """The least busy policy engine whose weights are `model` (an engine model name), if any."""
        candidates = [slot.member for slot in self.slots
                      if slot.holds == model and slot.member.in_rotation and slot.member.id not in exclude]
        load = least_loaded([member.load for member in candidates])
        return None if load is None else next(m for m in candidates if m.load is load)

    def rebase(self, body: bytes) -> bytes:
        """The request body with `model` set to the name the policy engine serves its weights under."""
        payload = orjson.loads(body)
        payload["model"] = self.base_model_id
        return orjson.dumps(payload)

    # ----------------------------------------------------------------------------- following

    def follow(self, model: str, step: int, adapter_path: Path) -> None:
        """`model`'s alias now serves `step`: make it the policy engines' target (unless pinned elsewhere)."""
        if self.model is not None and model != self.model:
            return
        self.target = PolicyTarget(f"{model}@{step}", str(adapter_path))
        self.kick()

    def kick(self) -> None:
        """Start a sync on every serving policy engine whose weights are not the target (and not refused)."""
        for slot in self.slots:
            if slot.member.in_rotation:
                self._start_sync(slot)

    def _start_sync(self, slot: PolicySlot) -> None:
        busy = slot.task is not None and not slot.task.done()
        if not busy and slot.holds != self.target.name and self.target.name not in slot.refused:
            slot.task = asyncio.create_task(self._sync(slot), name=f"artlike-policy-{slot.member.id}")

    async def stop(self) -> None:
        tasks = [slot.task for slot in self.slots if slot.task is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def _on_ready(self, slot: PolicySlot) -> Callable[[], Awaitable[None]]:
        async def ready() -> None:
            slot.holds = self.base_model_id  # a (re)started engine has the checkpoint's own weights
            slot.member.phase = Phase.SERVING
            logger.info("policy engine %s (%s) serves the base model", slot.member.id, slot.member.url)
            self._start_sync(slot)  # not `kick`: the supervisor marks the engine READY only after this returns

        return ready

    async def _sync(self, slot: PolicySlot) -> None:
        while (target := self.target).name != slot.holds and target.name not in slot.refused:
            started = time.perf_counter()
            if target.adapter_path is not None:
                try:  # from headers, before anything changes: the engine keeps what it holds
                    await asyncio.to_thread(check_mergeable, Path(target.adapter_path), self.model_dir)
                except UnsupportedAdapter as error:
                    self._refuse(slot, target, error)
                    return
            slot.holds = None  # out of the policy rotation: its requests go to the LoRA engines meanwhile
            try:
                await self._drain(slot)
                await slot.member.client.merge_weights(target.adapter_path, target.name)
                if target.adapter_path is not None:
                    slot.probe_diff = await self._verify(slot, target)
            except ProbeMismatch as error:
                self._refuse(slot, target, error)
                if not await self._back_to_base(slot):
                    return
                continue
            except (httpx.TransportError, EngineRequestError) as error:
                # Unreachable or dead: the supervisor restarts it and `_on_ready` resyncs it.
                logger.error("policy engine %s could not take %s: %s", slot.member.id, target.name, error)
                return
            except APIError as error:  # the LoRA engines could not score the step: deleted meanwhile, or down
                if isinstance(error, NotFound):
                    self._refuse(slot, target, error)
                else:  # tried again at the next maintenance round
                    logger.error("policy engine %s could not verify %s: %s", slot.member.id, target.name, error.message)
                if not await self._back_to_base(slot) or not isinstance(error, NotFound):
                    return
                continue
            slot.holds = target.name
            slot.syncs += 1
            slot.last_sync_s = time.perf_counter() - started
            logger.info("policy engine %s serves %s from merged weights (%.2f s, probe |Δ| %s)", slot.member.id,
                        target.name, slot.last_sync_s, slot.probe_diff)

    async def _drain(self, slot: PolicySlot) -> None:
        """Wait for the requests routed to it before it left the rotation, streams included: one routed just
        before could otherwise reach vLLM after the pause and be answered by the new weights. (The pause
        then waits for vLLM's own in-flight work.)"""
        deadline = time.monotonic() + self.drain_timeout_s
        # The pool counts requests down as they end (in several places): a short poll, not an Event.
        while slot.member.load.outstanding > 0 and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(DRAIN_POLL_S)

    @staticmethod
    def _refuse(slot: PolicySlot, target: PolicyTarget, error: Exception) -> None:
        slot.refused[target.name] = str(error)
        logger.warning("policy engine %s: %s stays LoRA-served: %s", slot.member.id, target.name, error)

    async def _back_to_base(self, slot: PolicySlot) -> bool:
        try:
            await slot.member.client.merge_weights(None, self.base_model_id)
        except (httpx.TransportError, EngineRequestError) as error:
            logger.error("policy engine %s could not go back to the base weights: %s", slot.member.id, error)
            return False
        slot.holds = self.base_model_id
        return True

    async def _verify(self, slot: PolicySlot, target: PolicyTarget) -> float:
        if self._probe is None:
            self._probe = await slot.member.client.tokenize(self.base_model_id, PROBE_TEXT)
        merged = await slot.member.client.token_logprobs(self.base_model_id, self._probe, 1)
        reference = await self.reference(target.name, self._probe, 1)
        diff = mean_abs_diff(merged, reference)
        if diff > self.tolerance:
            raise ProbeMismatch(f"merged weights give logprobs {diff:.4f} (mean |Δ|) from the LoRA engine's; "
                                f"tolerance {self.tolerance}")
        return diff


def mean_abs_diff(a: Sequence[float], b: Sequence[float]) -> float:
    """Mean |a_i − b_i|; e.g. [−1.0, −2.0] vs [−1.5, −2.0] → 0.25. Sequences must be equally long."""
    if len(a) != len(b) or not a:
        raise ValueError(f"cannot compare {len(a)} logprobs with {len(b)}")
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)
