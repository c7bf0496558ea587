"""The trainable-model registry: what `/v1/trainable_models` does, without HTTP.

It checks a registration against what this server serves (base model, the engine's LoRA rank, the base's
module names), has step 0 written by the trainer, and runs the `ModelManager` transactions behind the
other routes (alias, retention, evaluations, step deletion). Failures come out typed: an engine that
cannot load or unload is a 503 (`engine_unavailable`), a model in training a 409.

The trainer is reached through `AdapterInitializer`, a callable that already raises typed errors (the
trainer side's translation lives beside its client), so this package does not import the training one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import httpx

from artlike.types import (
    EvaluationRequest,
    LoraConfig,
    ModelInfo,
    RegisterModelRequest,
    RewardHeadConfig,
    SetAliasRequest,
    StepInfo,
    UpdateModelRequest,
)

from ..engine.client import EngineRequestError
from ..errors import Conflict, InvalidRequest
from ..state import BaseModelInfo
from .manager import AdapterRefused, ModelManager, engine_unavailable, served_name
from .store import ModelStore, StoredModel
from .targets import check_target_modules, read_module_names


class AdapterInitializer(Protocol):
    """Writes a fresh adapter for `name` (and a score head for a reward model) to `staging`; raises
    `InvalidRequest` for a LoRA config the trainer refuses, `ServiceUnavailable` when it is unavailable."""

    async def __call__(self, name: str, lora: LoraConfig, staging: Path, *,
                       reward_head: RewardHeadConfig | None) -> None: ...


class ModelRegistry:
    def __init__(self, store: ModelStore, manager: ModelManager, init_adapter: AdapterInitializer,
                 base: BaseModelInfo, is_training: Callable[[str], bool]) -> None:
        self.store = store
        self.manager = manager
        self._init_adapter = init_adapter
        self._base = base
        self._is_training = is_training

    # ------------------------------------------------------------------------------------ reads

    @property
    def base(self) -> BaseModelInfo:
        """The base model this server serves, which every model's steps adapt."""
        return self._base

    def is_training(self, name: str) -> bool:
        return self._is_training(name)

    def info(self, model: StoredModel) -> ModelInfo:
        """The model as the API shows it: its kept steps (loaded? held back?) and the step it serves."""
        store, manager = self.store, self.manager
        history = store.read_history(model.name)
        held_back = {e["step"] for e in history if isinstance(e.get("step"), int) and e.get("promoted") is False}
        held_back -= {e.get("alias_step") for e in history if e.get("event") == "alias"}  # promoted later
        steps = [
            StepInfo(
                step=step,
                served_name=served_name(model.name, step),
                created_at=store.step_created_at(model.name, step),
                loaded=manager.is_loaded(model.name, step),
                promoted=step not in held_back,
            )
            for step in store.steps(model.name)
        ]
        latest = manager.latest_step(model.name)
        latest = latest if latest is not None else (steps[-1].step if steps else 0)
        return ModelInfo(
            name=model.name,
            base_model=model.base_model,
            lora=model.lora,
            latest_step=latest,
            newest_step=manager.newest_step(model.name),
            served_name=served_name(model.name, latest),
            created_at=model.created_at,
            steps=steps,
            retention=model.retention,
            kind=model.kind,
            reward_head=model.reward_head,
        )

    def get(self, name: str) -> ModelInfo:
        return self.info(self.store.require(name))

    def all(self) -> list[ModelInfo]:
        return [self.info(m) for m in self.store.all()]

    async def history(self, name: str) -> list[dict[str, Any]]:
        self.store.require(name)
        return await asyncio.to_thread(self.store.read_history, name)

    # ------------------------------------------------------------------------------------ changes

    async def register(self, request: RegisterModelRequest) -> tuple[ModelInfo, bool]:
        """Create the model with its step 0 served, or return the existing one. Returns (model, created)."""
        base = self._base
        if request.base_model not in {base.name, str(base.path)}:
            raise InvalidRequest(f"this server serves base model {base.name!r}, not {request.base_model!r}",
                                 param="base_model", code="base_model_mismatch")
        if request.lora.rank > base.max_lora_rank:
            raise InvalidRequest(
                f"lora.rank {request.lora.rank} exceeds the engine's --max-lora-rank {base.max_lora_rank}",
                param="lora.rank", code="invalid_value")
        modules = await asyncio.to_thread(read_module_names, base.path)
        if modules is not None:
            check_target_modules(request.lora.target_modules, modules)

        async def write_step0(staging: Path) -> None:
            await self._init_adapter(request.name, request.lora, staging, reward_head=request.reward_head)

        try:
            model, created = await self.manager.register(request.name, base.name, request.lora,
                                                         request.retention, write_step0, kind=request.kind,
                                                         reward_head=request.reward_head)
        except (httpx.TransportError, EngineRequestError, AdapterRefused) as error:
            raise engine_unavailable(error, f"load step 0 of {request.name!r}") from error
        return self.info(model), created

    async def update(self, name: str, request: UpdateModelRequest) -> ModelInfo:
        """Change what may change after registration: the step retention policy (applied at once)."""
        return self.info(await self.manager.set_retention(name, request.retention))

    async def set_alias(self, name: str, request: SetAliasRequest) -> ModelInfo:
        """Serve a kept step under the alias `name`: a rollback, a promotion of a held-back step, or back."""
        model = self.store.require(name)
        if self._is_training(name):
            raise Conflict(f"model {name!r} is training; move its alias after the job finishes",
                           code="training_in_progress")
        try:
            await self.manager.set_alias(name, request.step, reason=request.reason or "set by API")
        except (httpx.TransportError, EngineRequestError, AdapterRefused) as error:
            raise engine_unavailable(error, f"serve step {request.step} of {name!r}") from error
        return self.info(model)

    async def record_evaluation(self, name: str, request: EvaluationRequest) -> dict[str, Any]:
        return await self.manager.record_evaluation(name, request.step, request.metrics, request.split)

    async def keep_newest_steps(self, name: str, keep: int) -> tuple[list[int], list[StepInfo]]:
        """Delete all but the newest `keep` steps (the served one is always kept). Returns (deleted, kept)."""
        model = self.store.require(name)
        if self._is_training(name):
            raise Conflict(f"model {name!r} is training; delete steps after the job finishes",
                           code="training_in_progress")
        steps = self.store.steps(name)
        doomed = steps[:-keep] if keep < len(steps) else []
        try:
            deleted = await self.manager.delete_steps(name, doomed)
        except (httpx.TransportError, EngineRequestError) as error:
            raise engine_unavailable(error, f"unload steps of {name!r}") from error
        return deleted, self.info(model).steps
