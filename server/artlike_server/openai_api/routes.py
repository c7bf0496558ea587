"""The OpenAI-compatible API's routes: completions, chat, responses, messages and the model list."""

from __future__ import annotations

from fastapi import FastAPI

from .api_router import router


def attach(app: FastAPI) -> None:
    """Include this feature's routes in `app` (they find the server's parts through `state.get_state`)."""
    app.include_router(router)
