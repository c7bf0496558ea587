"""`POST /_train_model`: validate (4xx before any work), then stream the job's events as NDJSON."""

from __future__ import annotations

from collections.abc import AsyncIterator

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from artlike.types import STREAM_VERSION, TrainRequest

from ..state import get_state
from .job import RunningJob

router = APIRouter()


@router.post("/_train_model")
async def train_model(body: TrainRequest, request: Request) -> StreamingResponse:
    service = get_state(request).training
    prepared = await service.prepare(body)
    job = service.start(prepared)
    return StreamingResponse(
        _ndjson(job),
        media_type="application/x-ndjson",
        headers={"X-Artlike-Stream-Version": str(STREAM_VERSION), "Cache-Control": "no-cache",
                 "X-Accel-Buffering": "no"},
    )


async def _ndjson(job: RunningJob) -> AsyncIterator[bytes]:
    # One line per event, sent as it happens. If the client goes away, Starlette stops this generator;
    # the job itself is a separate task and runs to completion.
    async for event in job.stream():
        yield orjson.dumps(event.model_dump(mode="json")) + b"\n"
