"""The engine's key guard (loaded into vLLM with --middleware): every route but /health needs the key."""

from __future__ import annotations

import os

import httpx
import pytest
from artlike_server.engine.engine_auth import EngineKeyMiddleware
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

KEY = "engine-key"


async def answer(request: Request) -> Response:
    return Response(b"reached")


def guarded_client() -> httpx.AsyncClient:
    # The paths vLLM's own --api-key leaves open (/invocations runs any generation) and one it guards.
    paths = ["/health", "/invocations", "/tokenize", "/scale_elastic_ep", "/v1/load_lora_adapter"]
    app = Starlette(routes=[Route(path, answer, methods=["GET", "POST"]) for path in paths])
    app.add_middleware(EngineKeyMiddleware, api_key=KEY)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine")


@pytest.mark.parametrize("path", ["/invocations", "/tokenize", "/scale_elastic_ep", "/v1/load_lora_adapter"])
async def test_every_engine_route_but_health_needs_the_key(path: str) -> None:
    async with guarded_client() as http:
        assert (await http.post(path)).status_code == 401
        assert (await http.post(path, headers={"Authorization": "Bearer wrong"})).status_code == 401
        reached = await http.post(path, headers={"Authorization": f"Bearer {KEY}"})
        assert (reached.status_code, reached.content) == (200, b"reached")


async def test_engine_health_stays_open_for_the_supervisor() -> None:
    async with guarded_client() as http:
        assert (await http.get("/health")).content == b"reached"


@pytest.mark.skipif(bool(os.environ.get("VLLM_API_KEY")), reason="VLLM_API_KEY is set in this environment")
def test_the_guard_refuses_to_run_without_a_key() -> None:
    with pytest.raises(RuntimeError, match="VLLM_API_KEY"):
        EngineKeyMiddleware(answer)
