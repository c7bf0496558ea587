"""The training routes: `/_train_model` and training sessions."""

from __future__ import annotations

from fastapi import FastAPI

from .api_router import router as training_router
from .sessions_router import router as sessions_router


def attach(app: FastAPI) -> None:
    """Include this feature's routes in `app` (they find the server's parts through `state.get_state`)."""
    app.include_router(training_router)
    app.include_router(sessions_router)
