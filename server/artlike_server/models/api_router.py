"""HTTP routes for trainable models: register, inspect, list and delete steps."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request, Response

from artlike.types import ModelInfo, RegisterModelRequest, StepInfo

from ..errors import Conflict, InvalidRequest
from ..state import AppState, get_state
from .manager import served_name
from .store import StoredModel

router = APIRouter()


def model_info(state: AppState, model: StoredModel) -> ModelInfo:
    store, manager = state.store, state.models
    steps = [
        StepInfo(
            step=step,
            served_name=served_name(model.name, step),
            created_at=store.step_created_at(model.name, step),
            loaded=manager.is_loaded(model.name, step),
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
        served_name=served_name(model.name, latest),
        created_at=model.created_at,
        steps=steps,
    )


@router.post("/v1/trainable_models", response_model=ModelInfo)
async def register_model(body: RegisterModelRequest, request: Request, response: Response) -> ModelInfo:
    state = get_state(request)
    accepted = {state.settings.served_model_name, str(state.settings.model_path)}
    if body.base_model not in accepted:
        raise InvalidRequest(
            f"this server serves base model {state.settings.served_model_name!r}, not {body.base_model!r}",
            param="base_model", code="base_model_mismatch",
        )
    if body.lora.rank > state.settings.max_lora_rank:
        raise InvalidRequest(
            f"lora.rank {body.lora.rank} exceeds the engine's --max-lora-rank {state.settings.max_lora_rank}",
            param="lora.rank", code="invalid_value",
        )
    async with state.registration_lock:
        existing = state.store.get(body.name)
        if existing is not None:
            if existing.lora != body.lora:
                raise Conflict(
                    f"model {body.name!r} is already registered with a different LoRA config "
                    f"({existing.lora.model_dump()}); pick another name or delete it",
                    param="lora", code="model_exists",
                )
            response.status_code = 200
            return model_info(state, existing)
        staging = state.store.new_staging_dir(body.name)
        try:
            await state.trainer.init_adapter(body.name, body.lora, staging)
            state.store.commit_step(body.name, staging, 0)
        finally:
            state.store.discard_staging(staging)
        model = state.store.create(body.name, state.settings.served_model_name, body.lora)
        await state.models.publish(body.name, 0)
    response.status_code = 201
    return model_info(state, model)


@router.get("/v1/trainable_models")
async def list_models(request: Request) -> dict[str, list[ModelInfo]]:
    state = get_state(request)
    return {"data": [model_info(state, m) for m in state.store.all()]}


@router.get("/v1/trainable_models/{name}", response_model=ModelInfo)
async def get_model(name: str, request: Request) -> ModelInfo:
    state = get_state(request)
    return model_info(state, state.store.require(name))


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
    for step in doomed:
        await state.models.forget_step(name, step)
        state.store.delete_step(name, step)
    return {"deleted": doomed, "data": model_info(state, model).steps}
