"""Every error the server answers is in the OpenAI shape, with the right status — bugs included.

Through the real app (`app.create_app`: its middleware stack, exception handlers and routers) and a small
FastAPI app with the same handlers and body-size middleware. No engine: these are the error paths.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from artlike_server.app import create_app_from_settings
from artlike_server.errors import install_error_handlers
from artlike_server.middleware import BodySizeLimitMiddleware
from artlike_server.settings import ServerSettings
from fastapi import FastAPI
from pydantic import BaseModel

from artlike.types import TrainRequest

LIMIT = 1000


class Body(BaseModel):
    text: str


def body_model_app() -> FastAPI:
    """A FastAPI route with a pydantic body, as /_train_model and /v1/trainable_models have."""
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=LIMIT)

    @app.post("/typed")
    async def typed(body: Body) -> dict[str, int]:
        return {"length": len(body.text)}

    @app.get("/bug")
    async def bug() -> dict[str, int]:
        raise RuntimeError("a bug")

    return app


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    # raise_app_exceptions=False: Starlette re-raises a bug after answering it; the client sees the answer.
    transport = httpx.ASGITransport(app=body_model_app(), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield client


def assert_openai_error(response: httpx.Response, status: int, error_type: str) -> dict[str, object]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == error_type
    return error


async def test_a_chunked_body_over_the_limit_on_a_body_model_route_is_413(http: httpx.AsyncClient) -> None:
    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: FastAPI reads it, then sees the error
        for _ in range(5):
            yield b'{"text": "' + b"y" * 300

    response = await http.post("/typed", content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in response.request.headers
    error = assert_openai_error(response, 413, "invalid_request_error")
    assert error["code"] == "request_too_large"
    small = await http.post("/typed", json={"text": "abc"})
    assert small.json() == {"length": 3}


async def test_an_unexpected_exception_is_a_500_in_the_openai_shape_with_a_request_id(
    http: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="artlike_server.errors"):
        response = await http.get("/bug")
    error = assert_openai_error(response, 500, "server_error")
    request_id = response.headers["x-request-id"]
    assert error["code"] == "internal_error"
    assert "RuntimeError" in str(error["message"]) and request_id in str(error["message"])
    logged = [r for r in caplog.records if request_id in r.getMessage()]
    assert logged and logged[0].exc_info is not None  # the traceback is in the log under the same id


async def test_a_bug_behind_the_real_apps_completion_fast_path_is_a_json_500(tmp_path: Path) -> None:
    """The real app, its lifespan not run: its state is missing, so every route fails unexpectedly — the
    completion routes (answered by a pure ASGI layer ahead of FastAPI) as much as the FastAPI ones."""
    settings = ServerSettings(model_path=tmp_path, served_model_name="base", data_dir=tmp_path)
    transport = httpx.ASGITransport(app=create_app_from_settings(settings), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as client:
        for method, path in (("POST", "/t/abc/v1/chat/completions"), ("POST", "/v1/completions"),
                             ("GET", "/v1/trainable_models"), ("GET", "/health")):
            response = await client.request(method, path, json={"model": "base", "prompt": "hi"})
            error = assert_openai_error(response, 500, "server_error")
            assert error["code"] == "internal_error", path


@pytest.mark.parametrize("reward", ["NaN", "Infinity", "-Infinity"])
def test_a_non_finite_reward_or_metric_is_rejected_for_recorded_and_offline_trajectories(reward: str) -> None:
    offline = ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], '
               '"reward": %s}')
    recorded = '{"trajectory_id": "t1", "reward": %s}'
    metric = '{"trajectory_id": "t1", "reward": 1.0, "metrics": {"m": %s}}'
    for trajectory in (offline, recorded, metric):
        body = '{"model": "m", "groups": [{"trajectories": [%s]}]}' % (trajectory % reward)
        with pytest.raises(ValueError, match="finite"):
            TrainRequest.model_validate_json(body)  # pydantic reads NaN/Infinity in JSON, then refuses it
