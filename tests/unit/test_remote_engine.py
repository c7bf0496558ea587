"""`--engine-url` engines (engine/remote.py): watched over real HTTP against a small stand-in vLLM server
(aiohttp on a loopback port) whose health, key and model list the tests change."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest
import pytest_asyncio
from aiohttp import web
from artlike_server.engine.client import EngineClient
from artlike_server.engine.remote import RemoteEngine, RemoteEngineError
from artlike_server.engine.supervisor import EngineState, SupervisionPolicy

KEY = "remote-key"
FAST = SupervisionPolicy(health_interval_s=0.05, health_timeout_s=1.0, unhealthy_checks_before_restart=2)


@dataclass
class Remote:
    url: str
    healthy: bool = True
    model: str = "base"
    joins: list[int] = field(default_factory=list)


@pytest_asyncio.fixture
async def remote() -> AsyncIterator[Remote]:
    state = Remote("")

    async def health(_: web.Request) -> web.Response:
        return web.json_response({}, status=200 if state.healthy else 503)

    async def models(request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {KEY}":
            return web.json_response({"error": "unauthorized"}, status=401)
        return web.json_response({"data": [{"id": state.model, "root": "/w", "parent": None}]})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    state.url = f"http://127.0.0.1:{port}"
    yield state
    await runner.cleanup()


def watcher(remote: Remote, key: str = KEY) -> tuple[RemoteEngine, EngineClient]:
    client = EngineClient(remote.url)
    client.set_api_key(key)
    engine = RemoteEngine(client, "base", policy=FAST)

    async def joined() -> None:
        remote.joins.append(1)

    engine.add_on_ready(joined)
    return engine, client


async def test_a_healthy_engine_of_the_right_model_joins_at_once(remote: Remote) -> None:
    engine, client = watcher(remote)
    await engine.start()
    assert engine.state is EngineState.READY and remote.joins == [1] and engine.pid is None
    await engine.stop()
    await client.aclose()


@pytest.mark.parametrize(("key", "model", "message"), [
    ("wrong", "base", "is --engine-key right"),
    (KEY, "another-model", "serves \\['another-model'\\], not 'base'"),
])
async def test_a_misconfigured_engine_is_refused_loudly(remote: Remote, key: str, model: str, message: str) -> None:
    remote.model = model
    engine, client = watcher(remote, key)
    with pytest.raises(RemoteEngineError, match=message):
        await engine.start()
    assert engine.state is EngineState.FAILED and remote.joins == []
    await engine.stop()
    await client.aclose()


async def test_an_engine_that_goes_down_leaves_and_rejoins_when_it_answers(remote: Remote) -> None:
    remote.healthy = False
    engine, client = watcher(remote)
    await engine.start()  # not up yet: not an error, it is polled
    assert engine.state is EngineState.RESTARTING and engine.retry_after() > 0
    remote.healthy = True
    await _until(lambda: engine.state is EngineState.READY)
    assert remote.joins == [1] and engine.restarts == 1

    remote.healthy = False
    await _until(lambda: engine.state is EngineState.RESTARTING)
    remote.healthy = True
    await _until(lambda: engine.state is EngineState.READY)
    assert remote.joins == [1, 1] and engine.restarts == 2  # every return replays the adapters (on_ready)
    await engine.stop()
    await client.aclose()


async def _until(condition: Callable[[], bool]) -> None:
    """Poll the watcher's state (it changes inside its own task; there is no event to wait on)."""
    async with asyncio.timeout(10.0):
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.02)
