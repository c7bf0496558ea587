"""`POST /_train_model`: validate (4xx before any work), then stream the job's events as NDJSON.

The body (up to the body limit, tens of MB of offline trajectories) is parsed and validated in a worker
thread (the body schema is `artlike.types.TrainRequest`; it is not in /openapi.json).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic_core import ErrorDetails

from artlike.types import OBJECTIVES, PAIR_KINDS, STREAM_VERSION, TrainRequest

from ..http_body import parse_body, parse_json
from ..state import get_state
from .job import RunningJob

router = APIRouter()


@router.post("/_train_model")
async def train_model(request: Request) -> StreamingResponse:
    body = await parse_body(request, TrainRequest, in_thread=True, locate=_without_union_tag)
    service = get_state(request).training
    prepared = await service.prepare(body)
    job = service.start(prepared)
    return StreamingResponse(
        _ndjson(job),
        media_type="application/x-ndjson",
        headers={"X-Artlike-Stream-Version": str(STREAM_VERSION), "Cache-Control": "no-cache",
                 "X-Accel-Buffering": "no"},
    )


def parse_train_request(raw: bytes) -> TrainRequest:
    """Parse and validate a body; an invalid one raises the same 400 as FastAPI's body models."""
    return parse_json(raw, TrainRequest, locate=_without_union_tag)


def _without_union_tag(error: ErrorDetails) -> ErrorDetails:
    """pydantic puts a union's tag in the location (`config.grpo.learning_rate`, `pairs.0.messages.prompt`);
    callers sent `config.learning_rate` and `pairs.0.prompt`, so that is the parameter to name."""
    loc = tuple(error.get("loc", ()))
    if len(loc) > 2 and loc[0] == "config" and loc[1] in OBJECTIVES:
        return {**error, "loc": (loc[0], *loc[2:])}
    if len(loc) > 2 and loc[0] == "pairs" and loc[2] in PAIR_KINDS:  # pairs.0.recorded.chosen_trajectory_id
        return {**error, "loc": (*loc[:2], *loc[3:])}
    return error


async def _ndjson(job: RunningJob) -> AsyncIterator[bytes]:
    # One line per event, sent as it happens. If the client goes away, Starlette stops this generator;
    # the job itself is a separate task and runs to completion.
    async for event in job.stream():
        yield orjson.dumps(event.model_dump(mode="json")) + b"\n"
