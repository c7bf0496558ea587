"""HTTP routes of training sessions (`artlike.session_types`); thin: the work is `TrainingSessions`'."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from artlike.session_types import (
    ForwardBackwardRequest,
    ForwardRequest,
    LoadStateRequest,
    OpenSessionRequest,
    OptimStepRequest,
    OptimStepResult,
    PassResult,
    SavedState,
    SaveStateRequest,
    SessionInfo,
)

from ..http_body import parse_body
from ..state import get_state
from .sessions import TrainingSessions

router = APIRouter(prefix="/v1/training_sessions")


def _sessions(request: Request) -> TrainingSessions:
    return get_state(request).sessions


@router.post("", response_model=SessionInfo, status_code=201)
async def open_session(request: Request) -> SessionInfo:
    return await _sessions(request).open(await parse_body(request, OpenSessionRequest))


@router.get("/{session_id}", response_model=SessionInfo)
async def get_session(session_id: str, request: Request) -> SessionInfo:
    return _sessions(request).get(session_id)


@router.delete("/{session_id}", response_model=SessionInfo)
async def end_session(session_id: str, request: Request) -> SessionInfo:
    return await _sessions(request).close(session_id)


@router.post("/{session_id}/forward_backward", response_model=PassResult)
async def forward_backward(session_id: str, request: Request) -> PassResult:
    body = await parse_body(request, ForwardBackwardRequest)
    return await _sessions(request).forward_backward(session_id, body)


@router.post("/{session_id}/forward", response_model=PassResult)
async def forward(session_id: str, request: Request) -> PassResult:
    body = await parse_body(request, ForwardRequest)
    return await _sessions(request).forward_backward(session_id, body, backward=False)


@router.post("/{session_id}/optim_step", response_model=OptimStepResult)
async def optim_step(session_id: str, request: Request) -> OptimStepResult:
    return await _sessions(request).optim_step(session_id, await parse_body(request, OptimStepRequest))


@router.post("/{session_id}/save_state", response_model=SavedState)
async def save_state(session_id: str, request: Request, response: Response) -> SavedState:
    body = await parse_body(request, SaveStateRequest, default=SaveStateRequest())
    response.status_code = 201
    return await _sessions(request).save_state(session_id, body)


@router.post("/{session_id}/load_state", response_model=SessionInfo)
async def load_state(session_id: str, request: Request) -> SessionInfo:
    return await _sessions(request).load_state(session_id, await parse_body(request, LoadStateRequest))
