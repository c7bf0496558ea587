"""`POST /v1/rewards` (thin: the work is `RewardScoring`'s)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from artlike.types import RewardsRequest, RewardsResponse

from ..http_body import parse_body
from ..state import get_state

router = APIRouter()


@router.post("/v1/rewards", response_model=RewardsResponse)
async def score(request: Request) -> RewardsResponse:
    """Score conversations (message lists, or recorded trajectories/completions) with a reward model."""
    return await get_state(request).scoring.score(await parse_body(request, RewardsRequest))
