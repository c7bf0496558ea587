"""HTTP routes of the Tinker API under `/api/v1` (thin: the work is `TinkerService`'s).

Training and sampling routes answer at once with a future (`request_id`); `retrieve_future` long-polls
for its outcome: JSON, protobuf (`forward_backward` and `sample` results), or `{"error", "category"}` with
status 200 as the SDK expects. Requests the server refuses outright get the OpenAI error shape with a 4xx,
which the SDK raises as its own exception types.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Query, Request, Response

from ..http_body import parse_body
from ..state import get_state
from .requests import (
    CreateModelBody,
    CreateSamplingSessionBody,
    CreateSessionBody,
    LoadWeightsBody,
    ModelBody,
    OptimStepBody,
    RetrieveFutureBody,
    SampleBody,
    SaveWeightsBody,
    SessionBody,
    WeightsInfoBody,
)
from .service import TinkerService
from .wire import PROTOBUF

router = APIRouter(prefix="/api/v1")


def _tinker(request: Request) -> TinkerService:
    return get_state(request).tinker


@router.post("/client/config")
async def client_config(request: Request) -> dict[str, Any]:
    return _tinker(request).client_config()


@router.post("/client/dynamic_config")
async def dynamic_config() -> dict[str, Any]:
    return {}


@router.get("/healthz")
async def healthz() -> dict[str, Any]:
    return {"status": "ok"}


@router.get("/get_server_capabilities")
async def capabilities(request: Request) -> dict[str, Any]:
    return _tinker(request).capabilities()


@router.post("/create_session")
async def create_session(request: Request) -> dict[str, Any]:
    return _tinker(request).create_session(await parse_body(request, CreateSessionBody))


@router.post("/session_heartbeat")
async def heartbeat(request: Request) -> dict[str, Any]:
    return _tinker(request).heartbeat((await parse_body(request, SessionBody)).session_id)


@router.post("/telemetry")
async def telemetry() -> dict[str, Any]:
    return {"status": "accepted"}


@router.post("/sessions/{session_id}/finish")
async def finish_session(session_id: str, request: Request) -> dict[str, Any]:
    return await _tinker(request).finish_session(session_id)


@router.get("/sessions/{session_id}")
async def describe_session(session_id: str, request: Request) -> dict[str, Any]:
    return _tinker(request).describe_session(session_id)


@router.post("/create_model")
async def create_model(request: Request) -> dict[str, Any]:
    return _tinker(request).create_model(await parse_body(request, CreateModelBody))


@router.post("/get_info")
async def get_info(request: Request) -> dict[str, Any]:
    return _tinker(request).get_info((await parse_body(request, ModelBody)).model_id)


@router.post("/forward_backward")
async def forward_backward(request: Request) -> dict[str, Any]:
    return _tinker(request).forward_backward(await request.body())


@router.post("/optim_step")
async def optim_step(request: Request) -> dict[str, Any]:
    return _tinker(request).optim_step(await parse_body(request, OptimStepBody))


@router.post("/save_weights")
async def save_weights(request: Request) -> dict[str, Any]:
    return _tinker(request).save_weights(await parse_body(request, SaveWeightsBody), for_sampler=False)


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(request: Request) -> dict[str, Any]:
    return _tinker(request).save_weights(await parse_body(request, SaveWeightsBody), for_sampler=True)


@router.post("/load_weights")
async def load_weights(request: Request) -> dict[str, Any]:
    return _tinker(request).load_weights(await parse_body(request, LoadWeightsBody))


@router.post("/create_sampling_session")
async def create_sampling_session(request: Request) -> dict[str, Any]:
    return _tinker(request).create_sampling_session(await parse_body(request, CreateSamplingSessionBody))


@router.get("/samplers/{sampler_id}")
async def sampler(sampler_id: str, request: Request) -> dict[str, Any]:
    return _tinker(request).sampler(sampler_id)


@router.post("/asample")
async def asample(request: Request) -> dict[str, Any]:
    return _tinker(request).asample(await parse_body(request, SampleBody))


@router.post("/retrieve_future")
async def retrieve_future(request: Request) -> Response:
    request_id = (await parse_body(request, RetrieveFutureBody)).request_id
    outcome = await _tinker(request).retrieve(request_id)
    if outcome is None:
        return _json({"type": "try_again", "request_id": request_id, "queue_state": "active"})
    if outcome.error is not None:
        return _json(outcome.as_json())
    if isinstance(outcome.payload, bytes):
        return Response(outcome.payload, media_type=PROTOBUF)
    return _json(outcome.payload)


@router.get("/training_runs")
async def training_runs(request: Request, limit: int = Query(20, ge=1, le=1000),
                        offset: int = Query(0, ge=0)) -> dict[str, Any]:
    return _tinker(request).training_runs(limit, offset)


@router.get("/training_runs/{run_id}")
async def training_run(run_id: str, request: Request) -> dict[str, Any]:
    return _tinker(request).training_run(run_id)


@router.get("/training_runs/{run_id}/checkpoints")
async def run_checkpoints(run_id: str, request: Request) -> dict[str, Any]:
    return _tinker(request).checkpoints(run_id)


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
async def delete_checkpoint(run_id: str, checkpoint_id: str, request: Request) -> dict[str, Any]:
    await _tinker(request).delete_checkpoint(run_id, checkpoint_id)
    return {}


@router.get("/checkpoints")
async def checkpoints(request: Request, limit: int = Query(100, ge=1, le=1000),
                      offset: int = Query(0, ge=0)) -> dict[str, Any]:
    return _tinker(request).all_checkpoints(limit, offset)


@router.post("/weights_info")
async def weights_info(request: Request) -> dict[str, Any]:
    return _tinker(request).weights_info((await parse_body(request, WeightsInfoBody)).tinker_path)


def _json(body: Any) -> Response:
    return Response(orjson.dumps(body), media_type="application/json")
