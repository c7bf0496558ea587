"""The training routes: `/_train_model`, training sessions, and the base model's tokenizer routes."""

from __future__ import annotations

from fastapi import FastAPI

from .api_router import router as training_router
from .sessions_router import router as sessions_router
from .tokenizer_router import router as tokenizer_router


def attach(app: FastAPI) -> None:
    """Include this feature's routes in `app` (they find the server's parts through `state.get_state`)."""
    app.include_router(training_router)
    app.include_router(sessions_router)
    app.include_router(tokenizer_router)
