"""The managed-job routes: files, graders, fine-tuning jobs and MotteRL's training API."""

from __future__ import annotations

from fastapi import FastAPI

from .files_router import router as files_router
from .graders_router import router as graders_router
from .jobs_router import router as jobs_router


def attach(app: FastAPI) -> None:
    """Include this feature's routes in `app` (they find the server's parts through `state.get_state`)."""
    app.include_router(files_router)
    app.include_router(graders_router)
    app.include_router(jobs_router)
