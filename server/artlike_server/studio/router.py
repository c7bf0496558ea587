"""HTTP routes of the studio's data: ratings, continual training, a reward model from ratings, trajectory
browsing (thin: the logic is in `ratings.py`, `continual.py`, `reward_training.py` and `trajectories.py`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

import orjson
from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import TypeAdapter

from artlike.studio_types import (
    ContinualPolicyUpdate,
    ContinualStatus,
    RatingList,
    RatingRequest,
    RewardModelFromRatings,
    TrajectoryView,
)
from artlike.types import STREAM_VERSION

from ..completion_queries import MAX_PAGE, parse_metadata_filter
from ..errors import InvalidRequest
from ..http_body import parse_body
from ..state import get_state
from ..training.job import RunningJob

router = APIRouter()
_RATING = TypeAdapter(RatingRequest)


def _jsonl(rows: list[dict[str, Any]]) -> Response:
    return Response(b"".join(orjson.dumps(row) + b"\n" for row in rows), media_type="application/x-ndjson")


@router.post("/v1/ratings", status_code=201, response_model=RatingList)
async def rate(request: Request) -> RatingList:
    """Rate one recorded completion (thumb, scale, skip) or rank several (best first)."""
    body = await parse_body(request, _RATING)
    # The page (it sends its CSRF token) rates as "studio"; API clients as "api" unless they name a rater.
    from_page = bool(request.headers.get("x-csrf-token"))
    ratings = await get_state(request).ratings.rate(body, default_rater="studio" if from_page else "api")
    return RatingList(data=ratings, last_id=ratings[-1].id)


@router.get("/v1/ratings", response_model=None)
async def list_ratings(
    request: Request, model: str | None = None, step: int | None = None, rater: str | None = None,
    kind: Literal["thumb", "scale", "ranking", "skip"] | None = None, after: int | None = Query(None, ge=0),
    limit: int = Query(100, ge=1, le=MAX_PAGE), format: Literal["json", "jsonl"] = "json",
) -> RatingList | Response:
    service = get_state(request).ratings
    ratings = await service.find(model=model, step=step, rater=rater, kind=kind, after=after, limit=limit + 1)
    page = ratings[:limit]
    if format == "jsonl":
        return _jsonl(await service.export(page))
    return RatingList(data=page, has_more=len(ratings) > limit, last_id=page[-1].id if page else None)


@router.get("/v1/ratings/pairs", response_model=None)
async def rating_pairs(request: Request, model: str | None = None,
                       format: Literal["json", "jsonl"] = "json") -> dict[str, Any] | Response:
    pairs = await get_state(request).ratings.pairs(model)
    if format == "jsonl":
        return _jsonl([p.model_dump() for p in pairs])
    return {"object": "list", "data": [p.model_dump() for p in pairs]}


@router.post("/v1/ratings/train_reward_model")
async def train_reward_model_from_ratings(request: Request) -> StreamingResponse:
    """Train a reward model on the train-split ratings (pairs and/or scores): the /_train_model NDJSON stream."""
    body = await parse_body(request, RewardModelFromRatings)
    job = await get_state(request).reward_trainer.start(body)
    return StreamingResponse(_ndjson(job), media_type="application/x-ndjson", headers={
        "X-Artlike-Stream-Version": str(STREAM_VERSION), "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _ndjson(job: RunningJob) -> AsyncIterator[bytes]:
    # As /_train_model's: one line per event as it happens; the job runs on if the client goes away.
    async for event in job.stream():
        yield orjson.dumps(event.model_dump(mode="json")) + b"\n"


@router.get("/v1/ratings/inbox")
async def inbox(request: Request, model: str | None = None, step: int | None = None,
                metadata: Annotated[list[str] | None, Query()] = None, before: int | None = Query(None, ge=0),
                limit: int = Query(20, ge=1, le=200)) -> dict[str, Any]:
    items, has_more = await get_state(request).ratings.inbox(
        model=model, step=step, metadata=parse_metadata_filter(metadata or []), before=before, limit=limit)
    return {"object": "list", "data": [i.model_dump() for i in items], "has_more": has_more}


@router.get("/v1/trainable_models/{name}/continual", response_model=ContinualStatus)
async def continual_status(name: str, request: Request) -> ContinualStatus:
    return await get_state(request).continual.status(name)


@router.patch("/v1/trainable_models/{name}/continual", response_model=ContinualStatus)
async def update_continual(name: str, request: Request) -> ContinualStatus:
    update = await parse_body(request, ContinualPolicyUpdate)
    return await get_state(request).continual.update_policy(name, update)


@router.get("/v1/trajectories")
async def list_trajectories(
    request: Request, model: str | None = None, step: int | None = None,
    metadata: Annotated[list[str] | None, Query()] = None, since: float | None = None, until: float | None = None,
    min_reward: float | None = None, max_reward: float | None = None, before: int | None = Query(None, ge=0),
    limit: int = Query(50, ge=1, le=MAX_PAGE),
) -> dict[str, Any]:
    if min_reward is not None and max_reward is not None and min_reward > max_reward:
        raise InvalidRequest("min_reward is above max_reward", param="min_reward", code="invalid_filter")
    items, has_more = await get_state(request).trajectories.list(
        model=model, step=step, metadata=parse_metadata_filter(metadata or []), since=since, until=until,
        min_reward=min_reward, max_reward=max_reward, before=before, limit=limit)
    return {"object": "list", "data": [i.model_dump() for i in items], "has_more": has_more,
            "last_id": items[-1].last_id if items else None}


@router.get("/v1/trajectories/{trajectory_id}/view", response_model=TrajectoryView)
async def view_trajectory(trajectory_id: str, request: Request) -> TrajectoryView:
    return await get_state(request).trajectories.view(trajectory_id)
