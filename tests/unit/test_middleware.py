"""API key, body size limit and request metrics middleware, through a real ASGI app."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from artlike_server.completion_log import CompletionLog
from artlike_server.errors import install_error_handlers
from artlike_server.metrics import Metrics
from artlike_server.middleware import (
    CSRF_HEADER,
    ApiKeyMiddleware,
    BodySizeLimitMiddleware,
    RequestMetricsMiddleware,
)
from artlike_server.studio.page_logins import COOKIE, PageLogins, cookie_value
from fastapi import FastAPI, Request
from fastapi.responses import Response

from tests.unit.fake_services import fake_services
from tests.unit.openai_fakes import FakeModels, FakeVLLM, Settings, build_app

KEY = "s3cret-key"
LIMIT = 1000


def small_app(metrics: Metrics, *, api_key: str | None = KEY) -> tuple[FastAPI, list[int]]:
    """An app whose /echo route reports the body size it read; `calls` counts requests that reached it."""
    calls: list[int] = []
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=LIMIT)
    app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)

    @app.post("/t/{trajectory_id}/echo")
    async def echo(trajectory_id: str, request: Request) -> Response:
        calls.append(1)
        body = await request.body()
        return Response(str(len(body)).encode())

    @app.get("/health")
    async def health() -> Response:
        return Response(b"ok")

    return app, calls


@pytest.fixture
async def client() -> AsyncIterator[tuple[httpx.AsyncClient, list[int], Metrics]]:
    metrics = Metrics()
    app, calls = small_app(metrics)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost:8000") as http:
        yield http, calls, metrics


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_api_key_is_required_everywhere_but_health(
    client: tuple[httpx.AsyncClient, list[int], Metrics],
) -> None:
    http, calls, _ = client
    for headers in ({}, bearer("wrong"), {"Authorization": KEY}, bearer(KEY + "x")):
        response = await http.post("/t/a/echo", content=b"{}", headers=headers)
        assert response.status_code == 401
        assert response.headers["www-authenticate"] == "Bearer"
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("authentication_error", "invalid_api_key")
    assert calls == []
    assert (await http.post("/t/a/echo", content=b"{}", headers=bearer(KEY))).text == "2"
    assert (await http.get("/health")).status_code == 200
    assert (await http.get("/no-such-route")).status_code == 401  # unknown routes reveal nothing either


async def test_anthropic_sdks_x_api_key_header_is_accepted_too(
    client: tuple[httpx.AsyncClient, list[int], Metrics],
) -> None:
    http, calls, _ = client
    assert (await http.post("/t/a/echo", content=b"{}", headers={"x-api-key": KEY})).text == "2"
    for headers in ({"x-api-key": "wrong"}, {"x-api-key": ""}, {"x-api-key": f"Bearer {KEY}"},
                    {"x-api-key": "wrong", "Authorization": "Bearer wrong"}):
        response = await http.post("/t/a/echo", content=b"{}", headers=headers)
        assert response.status_code == 401, headers
    assert calls == [1]


async def test_the_tinker_sdks_tml_form_of_the_key_is_accepted_in_x_api_key(
    client: tuple[httpx.AsyncClient, list[int], Metrics],
) -> None:
    http, _, _ = client
    assert (await http.post("/t/a/echo", content=b"{}", headers={"x-api-key": f"tml-{KEY}"})).status_code == 200
    for headers in ({"x-api-key": "tml-wrong"}, {"x-api-key": "tml-"}, {"Authorization": f"Bearer tml-{KEY}"}):
        assert (await http.post("/t/a/echo", content=b"{}", headers=headers)).status_code == 401, headers


async def test_no_key_configured_means_open() -> None:
    app, _ = small_app(Metrics(), api_key=None)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost:8000") as http:
        assert (await http.post("/t/a/echo", content=b"abc")).text == "3"


async def test_declared_oversized_body_is_refused_unread(
    client: tuple[httpx.AsyncClient, list[int], Metrics],
) -> None:
    http, calls, _ = client
    response = await http.post("/t/a/echo", content=b"x" * (LIMIT + 1), headers=bearer(KEY))
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"
    assert calls == []
    assert (await http.post("/t/a/echo", content=b"x" * LIMIT, headers=bearer(KEY))).text == str(LIMIT)


async def test_streamed_oversized_body_is_counted(
    client: tuple[httpx.AsyncClient, list[int], Metrics],
) -> None:
    http, calls, _ = client

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: chunked transfer
        for _ in range(5):
            yield b"y" * 300

    response = await http.post("/t/a/echo", content=chunks(), headers=bearer(KEY))
    assert "content-length" not in response.request.headers
    assert response.status_code == 413
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert calls == [1]  # the route started reading; the counting receive stopped it


async def test_metrics_use_route_templates_and_count_rejections(
    client: tuple[httpx.AsyncClient, list[int], Metrics],
) -> None:
    http, _, metrics = client
    await http.post("/t/traj-a/echo", content=b"{}", headers=bearer(KEY))
    await http.post("/t/traj-b/echo", content=b"{}", headers=bearer(KEY))
    await http.post("/t/traj-c/echo", content=b"{}")
    exposition = metrics.render().decode()
    assert (
        'artlike_requests_total{method="POST",route="/t/{trajectory_id}/echo",status="200"} 2.0' in exposition
    )
    assert 'artlike_requests_total{method="POST",route="unmatched",status="401"} 1.0' in exposition
    assert "traj-a" not in exposition
    assert "artlike_requests_in_flight 0.0" in exposition


async def test_openai_routes_and_metrics_endpoint_behind_the_key(tmp_path: Path) -> None:
    log = CompletionLog(tmp_path / "log.sqlite")
    log.open()
    fake = FakeVLLM()
    upstream = await fake.start()
    app = build_app(upstream, log, models=FakeModels("base"), settings=Settings(api_key=KEY))
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost:8000") as http:
            assert (await http.get("/v1/models")).status_code == 401
            assert (await http.get("/metrics")).status_code == 401
            body = {"model": "base", "messages": [{"role": "user", "content": "hi"}]}
            assert (await http.post("/t/x/v1/chat/completions", json=body)).status_code == 401
            assert fake.requests == []
            scraped = await http.get("/metrics", headers=bearer(KEY))
            assert scraped.status_code == 200 and scraped.headers["content-type"].startswith("text/plain")
            assert "artlike_engine_ready 1.0" in scraped.text
    finally:
        await upstream.aclose()
        await fake.stop()
        log.close()


async def test_metrics_middleware_can_find_the_metrics_at_request_time() -> None:
    """The app builds its Metrics at startup, after middleware is added: the middleware looks them up."""
    metrics = Metrics()
    app = FastAPI()
    app.add_middleware(RequestMetricsMiddleware)

    @app.get("/v1/models")
    async def models() -> Response:
        return Response(b"{}")

    app.state.artlike = fake_services(metrics=metrics)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost:8000") as http:
        await http.get("/v1/models")
    assert (
        'artlike_requests_total{method="GET",route="/v1/models",status="200"} 1.0'
        in metrics.render().decode()
    )


@pytest.mark.parametrize("api_key", [KEY, None])
async def test_browser_writes_from_another_origin_are_refused_with_or_without_a_key(api_key: str | None) -> None:
    app, calls = small_app(Metrics(), api_key=api_key)
    headers = bearer(KEY) if api_key else {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost:8000") as http:
        for origin, status in (("http://evil.example", 403), ("null", 403), ("http://localhost:8000", 200), (None, 200)):
            extra = {"Origin": origin} if origin else {}
            response = await http.post("/t/x/echo", content=b"{}", headers=headers | extra)
            assert response.status_code == status, (origin, response.text)
            if status == 403:
                assert response.json()["error"]["code"] == "cross_origin"
        assert len(calls) == 2
        # Reads are not writes: a cross-origin GET is up to the key check alone.
        assert (await http.get("/health", headers={"Origin": "http://evil.example"})).status_code == 200


async def test_a_page_login_cookie_authenticates_and_writes_need_its_csrf_token() -> None:
    logins = PageLogins()
    token, csrf = logins.create()
    calls: list[int] = []
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(ApiKeyMiddleware, api_key=KEY, logins=logins)

    @app.post("/v1/thing")
    async def thing() -> Response:
        calls.append(1)
        return Response(b"ok")

    cookie = {"Cookie": f"other=1; {COOKIE}={token}"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost:8000") as http:
        assert (await http.post("/v1/thing", headers=cookie | {CSRF_HEADER: csrf})).status_code == 200
        refused = await http.post("/v1/thing", headers=cookie)
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "csrf_failed"
        assert (await http.post("/v1/thing", headers=cookie | {CSRF_HEADER: "x" + csrf})).status_code == 403
        forged = {"Cookie": f"{COOKIE}=not-a-session", CSRF_HEADER: csrf}
        assert (await http.post("/v1/thing", headers=forged)).status_code == 401
        logins.end(token)
        assert (await http.post("/v1/thing", headers=cookie | {CSRF_HEADER: csrf})).status_code == 401
    assert calls == [1]


def test_page_logins_expire_after_their_idle_time() -> None:
    logins = PageLogins(ttl_s=0.0)
    token, _ = logins.create()
    assert logins.csrf_token(token) is None
    assert cookie_value(b"a=1; artlike_session=abc; b=2") == "abc" and cookie_value(b"a=1") is None
