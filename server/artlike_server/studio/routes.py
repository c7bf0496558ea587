"""The studio's routes: ratings and trajectories behind the page, and the page itself (`/ui`)."""

from __future__ import annotations

from fastapi import FastAPI

from .router import router as studio_router
from .ui_router import router as ui_router


def attach(app: FastAPI) -> None:
    """Include this feature's routes in `app` (they find the server's parts through `state.get_state`)."""
    app.include_router(studio_router)
    app.include_router(ui_router)
