"""Thin routers over `JobService`: OpenAI's `/v1/fine_tuning/jobs` and MotteRL's `/api/training/*`."""

from __future__ import annotations

from collections.abc import AsyncIterator

import orjson
from fastapi import APIRouter, Query, Request
from fastapi.responses import Response, StreamingResponse

from ..http_body import parse_body
from ..state import Services, get_state
from . import motterl, openai_jobs
from .http import json_response
from .service import JobService
from .store import EventRecord, JobRecord

router = APIRouter()


def _jobs(state: Services) -> JobService:
    return state.jobs


# ------------------------------------------------------------------------------- OpenAI fine-tuning


@router.post("/v1/fine_tuning/jobs")
async def create_job(request: Request) -> Response:
    state = get_state(request)
    create = await parse_body(request, openai_jobs.CreateJobRequest)
    new = openai_jobs.new_job(create, files=state.files, models=state.store,
                              served_base=state.base_model.name)
    return json_response(openai_jobs.job_object(_jobs(state).create(new)))


@router.get("/v1/fine_tuning/jobs")
async def list_jobs(request: Request, after: str | None = None, limit: int = Query(20, ge=1, le=100)) -> Response:
    metadata = {key[len("metadata["):-1]: value for key, value in request.query_params.items()
                if key.startswith("metadata[") and key.endswith("]")}
    jobs, has_more = _jobs(get_state(request)).page(limit=limit, after=after, metadata=metadata or None)
    return json_response({"object": "list", "data": [openai_jobs.job_object(j) for j in jobs], "has_more": has_more})


@router.get("/v1/fine_tuning/jobs/{fine_tuning_job_id}")
async def get_job(request: Request, fine_tuning_job_id: str) -> Response:
    return json_response(openai_jobs.job_object(_jobs(get_state(request)).get(fine_tuning_job_id)))


@router.post("/v1/fine_tuning/jobs/{fine_tuning_job_id}/cancel")
async def cancel_job(request: Request, fine_tuning_job_id: str) -> Response:
    return json_response(openai_jobs.job_object(await _jobs(get_state(request)).cancel(fine_tuning_job_id)))


@router.post("/v1/fine_tuning/jobs/{fine_tuning_job_id}/pause")
async def pause_job(request: Request, fine_tuning_job_id: str) -> Response:
    return json_response(openai_jobs.job_object(await _jobs(get_state(request)).pause(fine_tuning_job_id)))


@router.post("/v1/fine_tuning/jobs/{fine_tuning_job_id}/resume")
async def resume_job(request: Request, fine_tuning_job_id: str) -> Response:
    return json_response(openai_jobs.job_object(_jobs(get_state(request)).resume(fine_tuning_job_id)))


@router.get("/v1/fine_tuning/jobs/{fine_tuning_job_id}/events")
async def job_events(request: Request, fine_tuning_job_id: str, after: str | None = None,
                     limit: int = Query(20, ge=1, le=1000)) -> Response:
    events, has_more = _jobs(get_state(request)).events(fine_tuning_job_id, after=after, limit=limit)
    return json_response({"object": "list", "data": [openai_jobs.event_object(e) for e in events], "has_more": has_more})


@router.get("/v1/fine_tuning/jobs/{fine_tuning_job_id}/checkpoints")
async def job_checkpoints(request: Request, fine_tuning_job_id: str, after: str | None = None,
                          limit: int = Query(10, ge=1, le=1000)) -> Response:
    page, has_more = _jobs(get_state(request)).checkpoints(fine_tuning_job_id, after=after, limit=limit)
    return json_response({"object": "list", "data": [openai_jobs.checkpoint_object(c) for c in page],
                  "first_id": page[0].id if page else None, "last_id": page[-1].id if page else None,
                  "has_more": has_more})


# ------------------------------------------------------------------------------------------ MotteRL


@router.post("/api/training/start")
async def motterl_start(request: Request) -> Response:
    state = get_state(request)
    start = await parse_body(request, motterl.StartTraining)
    job = _jobs(state).create(motterl.new_job(start, models=state.store, served_base=state.base_model.name))
    return json_response({"job_id": job.id, "status": motterl.STATUS[job.status]})


@router.get("/api/training/status/{job_id}")
async def motterl_status(request: Request, job_id: str) -> Response:
    return json_response(motterl.status_object(_jobs(get_state(request)).get(job_id)))


@router.get("/api/training/jobs")
async def motterl_jobs(request: Request, limit: int = Query(100, ge=1, le=1000)) -> Response:
    jobs, _ = _jobs(get_state(request)).page(limit=limit, after=None)
    return json_response({"jobs": [motterl.status_object(j) for j in jobs]})


@router.post("/api/training/cancel/{job_id}")
async def motterl_cancel(request: Request, job_id: str) -> Response:
    job = await _jobs(get_state(request)).cancel(job_id)
    return json_response(motterl.status_object(job))


@router.get("/api/training/logs/{job_id}")
async def motterl_logs(request: Request, job_id: str, follow: bool = False, after: str | None = None) -> Response:
    """NDJSON: the job's events oldest first; with follow=true, new ones as they come, then the job object."""
    service = _jobs(get_state(request))
    service.get(job_id)

    async def lines() -> AsyncIterator[bytes]:
        if follow:
            async for item in service.follow(job_id, after=after):
                yield _line(item)
            return
        for event in service.all_events(job_id):
            yield _line(event)

    return StreamingResponse(lines(), media_type="application/x-ndjson")


def _line(item: EventRecord | JobRecord) -> bytes:
    body = openai_jobs.event_object(item) if isinstance(item, EventRecord) else openai_jobs.job_object(item)
    return orjson.dumps(body) + b"\n"
