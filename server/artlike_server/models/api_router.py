"""HTTP routes for trainable models: register, update, inspect, list and delete steps (thin: the\ntransactions are `ModelManager`'s)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
from fastapi import APIRouter, Query, Request, Response

from artlike.types import (
    EvaluationRequest,
    ModelInfo,
    RegisterModelRequest,
    SetAliasRequest,
    StepInfo,
    UpdateModelRequest,
)

from ..engine.client import EngineRequestError
from ..errors import Conflict, InvalidRequest, ServiceUnavailable
from ..state import AppState, get_state
from ..training.trainer_client import TrainerCrashed, TrainerError, TrainerTimeout
from .manager import AdapterRefused, engine_unavailable, served_name
from .store import StoredModel
from .targets import check_target_modules, read_module_names

_CONFIG_ERROR_KINDS = frozenset({"ValueError", "TypeError", "KeyError", "AdapterError"})
"""Worker-side exception types that mean PEFT refused the LoRA config (not a trainer bug)."""

router = APIRouter()


def model_info(state: AppState, model: StoredModel) -> ModelInfo:
    store, manager = state.store, state.models
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


@router.post("/v1/trainable_models", response_model=ModelInfo)
async def register_model(body: RegisterModelRequest, request: Request, response: Response) -> ModelInfo:
    state = get_state(request)
    accepted = {state.base_model.name, str(state.base_model.path)}
    if body.base_model not in accepted:
        raise InvalidRequest(
            f"this server serves base model {state.base_model.name!r}, not {body.base_model!r}",
            param="base_model", code="base_model_mismatch",
        )
    if body.lora.rank > state.base_model.max_lora_rank:
        raise InvalidRequest(
            f"lora.rank {body.lora.rank} exceeds the engine's --max-lora-rank {state.base_model.max_lora_rank}",
            param="lora.rank", code="invalid_value",
        )
    modules = await asyncio.to_thread(read_module_names, state.base_model.path)
    if modules is not None:
        check_target_modules(body.lora.target_modules, modules)

    async def write_step0(staging: Path) -> None:
        try:
            await state.trainer.init_adapter(body.name, body.lora, staging, reward_head=body.reward_head)
        except TrainerError as error:
            if error.kind in _CONFIG_ERROR_KINDS:  # PEFT refused the config: the caller's to fix
                raise InvalidRequest(f"the trainer cannot build this LoRA: {error.message}", param="lora",
                                     code="invalid_lora_config") from error
            raise
        except (TrainerCrashed, TrainerTimeout) as error:
            raise ServiceUnavailable(f"the trainer is not available: {error}", retry_after=30.0,
                                     code="trainer_unavailable") from error

    try:
        model, created = await state.models.register(body.name, state.base_model.name, body.lora,
                                                     body.retention, write_step0, kind=body.kind,
                                                     reward_head=body.reward_head)
    except (httpx.TransportError, EngineRequestError, AdapterRefused) as error:
        raise engine_unavailable(error, f"load step 0 of {body.name!r}") from error
    response.status_code = 201 if created else 200
    return model_info(state, model)


@router.patch("/v1/trainable_models/{name}", response_model=ModelInfo)
async def update_model(name: str, body: UpdateModelRequest, request: Request) -> ModelInfo:
    """Change what may change after registration: the step retention policy (applied at once)."""
    state = get_state(request)
    return model_info(state, await state.models.set_retention(name, body.retention))


@router.get("/v1/trainable_models")
async def list_models(request: Request) -> dict[str, list[ModelInfo]]:
    state = get_state(request)
    return {"data": [model_info(state, m) for m in state.store.all()]}


@router.get("/v1/trainable_models/{name}", response_model=ModelInfo)
async def get_model(name: str, request: Request) -> ModelInfo:
    state = get_state(request)
    return model_info(state, state.store.require(name))


@router.post("/v1/trainable_models/{name}/alias", response_model=ModelInfo)
async def set_alias(name: str, body: SetAliasRequest, request: Request) -> ModelInfo:
    """Serve a kept step under the alias `name`: a rollback, a promotion of a held-back step, or back again."""
    state = get_state(request)
    model = state.store.require(name)
    if state.training.is_training(name):
        raise Conflict(f"model {name!r} is training; move its alias after the job finishes",
                       code="training_in_progress")
    try:
        await state.models.set_alias(name, body.step, reason=body.reason or "set by API")
    except (httpx.TransportError, EngineRequestError, AdapterRefused) as error:
        raise engine_unavailable(error, f"serve step {body.step} of {name!r}") from error
    return model_info(state, model)


@router.get("/v1/trainable_models/{name}/history")
async def get_history(name: str, request: Request) -> dict[str, list[dict[str, Any]]]:
    """The model's history lines: one per committed step, one per alias move (`"event": "alias"`)."""
    state = get_state(request)
    state.store.require(name)
    return {"data": await asyncio.to_thread(state.store.read_history, name)}


@router.post("/v1/trainable_models/{name}/evaluations")
async def record_evaluation(name: str, body: EvaluationRequest, request: Request) -> dict[str, Any]:
    """Record a committed step's scores on held-out data as a history line (`"event": "eval"`); retention
    rules on `"eval.<metric>"` keep the best evaluated steps. Returns the line."""
    state = get_state(request)
    return await state.models.record_evaluation(name, body.step, body.metrics, body.split)


@router.get("/v1/trainable_models/{name}/steps")
async def list_steps(name: str, request: Request) -> dict[str, list[StepInfo]]:
    state = get_state(request)
    return {"data": model_info(state, state.store.require(name)).steps}


@router.delete("/v1/trainable_models/{name}/steps")
async def delete_steps(
    name: str, request: Request, keep: int = Query(..., ge=1, description="how many of the newest steps to keep")
) -> dict[str, list[int] | list[StepInfo]]:
    """Delete all but the newest `keep` steps. The latest step is always kept (it is being served)."""
    state = get_state(request)
    model = state.store.require(name)
    if state.training.is_training(name):
        raise Conflict(f"model {name!r} is training; delete steps after the job finishes", code="training_in_progress")
    steps = state.store.steps(name)
    doomed = steps[:-keep] if keep < len(steps) else []
    try:
        deleted = await state.models.delete_steps(name, doomed)
    except (httpx.TransportError, EngineRequestError) as error:
        raise engine_unavailable(error, f"unload steps of {name!r}") from error
    return {"deleted": deleted, "data": model_info(state, model).steps}
