"""The proxy's connection pool to one engine (engine/upstream.py), against a real local HTTP server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from artlike_server.engine.upstream import EngineConnectionError, Upstream
from artlike_server.launcher import free_port


@pytest.fixture
async def slow_engine() -> AsyncIterator[str]:
    """Answers every POST after 0.3 s, like a busy engine."""
    async def answer(request: web.Request) -> web.Response:
        await asyncio.sleep(0.3)
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def test_requests_beyond_the_pool_wait_for_a_connection_instead_of_failing(slow_engine: str) -> None:
    # One connection, a 0.2 s connect timeout, four requests of 0.3 s: the last waits ~0.9 s for the pool.
    # That wait is not a connect timeout (it was: "the engine is unreachable" while it was only busy).
    upstream = Upstream(slow_engine, max_connections=1, connect_timeout_s=0.2)
    try:
        async def one() -> bytes:
            response = await upstream.post("/v1/chat/completions", b"{}")
            return await response.read()

        assert await asyncio.gather(*(one() for _ in range(4))) == [b'{"ok": true}'] * 4
    finally:
        await upstream.aclose()


async def test_a_closed_port_is_unreachable() -> None:
    upstream = Upstream(f"http://127.0.0.1:{free_port()}", connect_timeout_s=0.2)
    try:
        with pytest.raises(EngineConnectionError, match="unreachable"):
            await upstream.post("/v1/chat/completions", b"{}")
    finally:
        await upstream.aclose()
