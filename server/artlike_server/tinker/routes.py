"""The Tinker API's routes (`/api/v1/...`), for the official `tinker` SDK and the tinker-cookbook."""

from __future__ import annotations

from fastapi import FastAPI

from .router import router


def attach(app: FastAPI) -> None:
    """Include this feature's routes in `app` (they find the server's parts through `state.get_state`)."""
    app.include_router(router)
