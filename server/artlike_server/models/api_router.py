"""HTTP routes for trainable models: register, update, inspect, list and delete steps (thin: the work is
`ModelRegistry`'s)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Request, Response

from artlike.types import (
    EvaluationRequest,
    ModelInfo,
    RegisterModelRequest,
    SetAliasRequest,
    StepInfo,
    UpdateModelRequest,
)

from ..http_body import parse_body
from ..state import get_state
from .registry import ModelRegistry

router = APIRouter()


def _registry(request: Request) -> ModelRegistry:
    return get_state(request).registry


@router.post("/v1/trainable_models", response_model=ModelInfo)
async def register_model(request: Request, response: Response) -> ModelInfo:
    body = await parse_body(request, RegisterModelRequest)
    model, created = await _registry(request).register(body)
    response.status_code = 201 if created else 200
    return model


@router.patch("/v1/trainable_models/{name}", response_model=ModelInfo)
async def update_model(name: str, request: Request) -> ModelInfo:
    """Change what may change after registration: the step retention policy (applied at once)."""
    return await _registry(request).update(name, await parse_body(request, UpdateModelRequest))


@router.get("/v1/trainable_models")
async def list_models(request: Request) -> dict[str, list[ModelInfo]]:
    return {"data": _registry(request).all()}


@router.get("/v1/trainable_models/{name}", response_model=ModelInfo)
async def get_model(name: str, request: Request) -> ModelInfo:
    return _registry(request).get(name)


@router.post("/v1/trainable_models/{name}/alias", response_model=ModelInfo)
async def set_alias(name: str, request: Request) -> ModelInfo:
    """Serve a kept step under the alias `name`: a rollback, a promotion of a held-back step, or back again."""
    return await _registry(request).set_alias(name, await parse_body(request, SetAliasRequest))


@router.get("/v1/trainable_models/{name}/history")
async def get_history(name: str, request: Request) -> dict[str, list[dict[str, Any]]]:
    """The model's history lines: one per committed step, one per alias move (`"event": "alias"`)."""
    return {"data": await _registry(request).history(name)}


@router.post("/v1/trainable_models/{name}/evaluations")
async def record_evaluation(name: str, request: Request) -> dict[str, Any]:
    """Record a committed step's scores on held-out data as a history line (`"event": "eval"`); retention
    rules on `"eval.<metric>"` keep the best evaluated steps. Returns the line."""
    return await _registry(request).record_evaluation(name, await parse_body(request, EvaluationRequest))


@router.get("/v1/trainable_models/{name}/steps")
async def list_steps(name: str, request: Request) -> dict[str, list[StepInfo]]:
    return {"data": _registry(request).get(name).steps}


@router.delete("/v1/trainable_models/{name}/steps")
async def delete_steps(
    name: str, request: Request, keep: int = Query(..., ge=1, description="how many of the newest steps to keep")
) -> dict[str, list[int] | list[StepInfo]]:
    """Delete all but the newest `keep` steps. The latest step is always kept (it is being served)."""
    deleted, kept = await _registry(request).keep_newest_steps(name, keep)
    return {"deleted": deleted, "data": kept}
