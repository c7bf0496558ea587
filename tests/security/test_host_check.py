"""A web page cannot reach this server through a name of its own (DNS rebinding): a request's `Host` must be
loopback, an IP address or a name the operator listed. Without a key every route refuses other names; with
a key the key is the defence, and the studio page and its cookie still refuse them.

The parsing and the policy as units; the middleware through the real app (`create_app`) and a small app;
the page, the cookie and the key against the real server."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from artlike_server.app import create_app, health
from artlike_server.cli import app as cli_app
from artlike_server.engine.supervisor import EngineState
from artlike_server.errors import install_error_handlers
from artlike_server.hosts import DEFAULT_HOSTS, HostPolicy, host_name
from artlike_server.launcher import ServerProcess
from artlike_server.middleware import ApiKeyMiddleware
from artlike_server.settings import ServerSettings
from artlike_server.studio.page_logins import COOKIE, PageLogins
from fastapi import FastAPI
from fastapi.responses import Response
from typer.testing import CliRunner

from tests.unit.fake_services import fake_services

EVIL = "rebind.example:8000"
KEY = "host-check-key"


@pytest.mark.parametrize(("header", "name"), [
    ("localhost", "localhost"), ("localhost:8000", "localhost"), ("LocalHost.:8000", "localhost"),
    ("127.0.0.1", "127.0.0.1"), ("127.0.0.1:8000", "127.0.0.1"), ("[::1]", "::1"), ("[::1]:8000", "::1"),
    ("[0:0:0:0:0:0:0:1]:80", "::1"), ("Studio.Example.COM.", "studio.example.com"), (" a-b_c.example ", "a-b_c.example"),
])
def test_host_header_forms_are_parsed(header: str, name: str) -> None:
    assert host_name(header.encode()) == name


@pytest.mark.parametrize("header", ["", ":8000", "::1", "[::1", "[::1]x", "[evil]:80", "a b", "evil.example:",
                                    "evil.example:80:80", "user@evil.example", "evil..example", ".", "evil/x"])
def test_malformed_host_headers_are_not_names(header: str) -> None:
    assert host_name(header.encode()) is None


@pytest.mark.parametrize("header", ["localhost:8000", "LOCALHOST.", "127.0.0.1:8000", "127.9.9.9", "[::1]:8000",
                                    "10.0.0.5:8000", "[fd00::5]"])
def test_loopback_and_addresses_are_allowed_by_default(header: str) -> None:
    assert HostPolicy().allows([header.encode()])


@pytest.mark.parametrize("header", [EVIL, "localhost.evil.example", "evil", "::1", "127.0.0.1.evil.example"])
def test_other_names_and_malformed_hosts_are_refused_by_default(header: str) -> None:
    assert not HostPolicy().allows([header.encode()])


def test_listed_names_star_the_bind_name_and_missing_or_repeated_hosts() -> None:
    policy = HostPolicy.from_options(["Studio.Example.com, lab.example", "other.example:9000"], "box.lan")
    for header in (b"studio.example.com:8000", b"LAB.EXAMPLE.", b"other.example", b"box.lan:8000", b"localhost"):
        assert policy.allows([header]), header
    assert not policy.allows([b"evil.example"])
    assert not policy.allows([b"localhost", b"evil.example"]), "two Host headers: neither is trusted"
    assert policy.allows([]), "no Host (HTTP/1.0) is never a browser's request"
    assert HostPolicy.from_options(["*"]).allows([b"anything.example"])
    assert HostPolicy.from_options([], "0.0.0.0").names == frozenset()  # an address adds no name
    with pytest.raises(ValueError, match="not a host name: 'bad/name'"):
        HostPolicy.from_options(["bad/name"])


def small_app(api_key: str | None, hosts: HostPolicy = DEFAULT_HOSTS,
              logins: PageLogins | None = None) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(ApiKeyMiddleware, api_key=api_key, logins=logins, hosts=hosts)
    app.add_api_route("/health", health, methods=["GET"])

    @app.api_route("/v1/thing", methods=["GET", "POST"])
    async def thing() -> Response:
        return Response(b"ok")

    @app.get("/ui")
    async def page() -> Response:
        return Response(b"page")

    app.state.artlike = fake_services(
        engine=SimpleNamespace(state=EngineState.READY, restarts=0, pid=1234, retry_after=lambda: 0.0,
                               describe=lambda: []),
        trainer=SimpleNamespace(is_running=True, pid=5678),
        models=SimpleNamespace(served_models={}), training=SimpleNamespace(active=lambda: []),
        sessions=SimpleNamespace(open_models=lambda: {}), jobs=SimpleNamespace(running_jobs=lambda: []),
        sandbox=SimpleNamespace(enforcement=lambda: {}),
    )
    return app


def client(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1:8000")


def assert_host_refused(response: httpx.Response, name: str = "rebind.example") -> None:
    assert response.status_code == 403, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("permission_error", "host_not_allowed")
    assert f"--allowed-hosts {name}" in error["message"]


async def test_without_a_key_a_rebound_page_is_refused_on_the_real_app(tmp_path: Path) -> None:
    """The reported attack: matching Origin and Host of the page's own name, on the real app's middleware."""
    async with client(create_app(fake_services())) as http:
        page = {"Host": EVIL, "Origin": f"http://{EVIL}"}
        assert_host_refused(await http.post("/v1/fine_tuning/alpha/graders/validate", json={}, headers=page))
        assert_host_refused(await http.get("/v1/models", headers={"Host": EVIL}))
        assert_host_refused(await http.get("/ui", headers={"Host": EVIL}))


async def test_without_a_key_loopback_names_listed_names_and_health() -> None:
    async with client(small_app(None, HostPolicy.from_options(["studio.example"]))) as http:
        for host in ("localhost:8000", "127.0.0.1:8000", "[::1]:8000", "LOCALHOST.", "studio.example:8000"):
            assert (await http.get("/v1/thing", headers={"Host": host})).text == "ok", host
        # The rebinding page's writes with a matching Origin, and reads
        assert_host_refused(await http.post("/v1/thing", headers={"Host": EVIL, "Origin": f"http://{EVIL}"}))
        assert_host_refused(await http.get("/v1/thing", headers={"Host": EVIL}))
        # /health answers any name (a load balancer's probe), but the details only to names it knows.
        assert (await http.get("/health", headers={"Host": EVIL})).json() == {"status": "ok"}
        assert "engine" in (await http.get("/health", headers={"Host": "localhost:8000"})).json()
        # The Origin check still holds for allowed names.
        crossed = await http.post("/v1/thing", headers={"Host": "localhost:8000", "Origin": f"http://{EVIL}"})
        assert crossed.status_code == 403 and crossed.json()["error"]["code"] == "cross_origin"
    async with client(small_app(None, HostPolicy.from_options(["*"]))) as http:
        assert (await http.get("/v1/thing", headers={"Host": EVIL})).text == "ok"


async def test_with_a_key_the_key_passes_any_name_but_the_page_and_its_cookie_do_not() -> None:
    logins = PageLogins()
    token, _ = logins.create()
    async with client(small_app(KEY, logins=logins)) as http:
        bearer = {"Authorization": f"Bearer {KEY}"}
        assert (await http.get("/v1/thing", headers=bearer | {"Host": EVIL})).text == "ok"
        assert "engine" in (await http.get("/health", headers=bearer | {"Host": EVIL})).json()
        assert (await http.get("/v1/thing", headers={"Host": EVIL})).status_code == 401
        assert_host_refused(await http.get("/ui", headers=bearer | {"Host": EVIL}))
        cookie = {"Cookie": f"{COOKIE}={token}"}
        assert_host_refused(await http.get("/v1/thing", headers=cookie | {"Host": EVIL}))
        assert (await http.get("/v1/thing", headers=cookie | {"Host": "localhost:8000"})).text == "ok"
        assert (await http.get("/ui", headers={"Host": "[::1]:8000"})).text == "page"


def test_allowed_hosts_from_the_command_line_and_the_environment(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[ServerSettings] = []
    monkeypatch.setattr("artlike_server.cli.run", lambda settings, **_: seen.append(settings) or 0)
    common = ["serve", "--model", str(tmp_path), "--device", "cpu", "--dtype", "float32", "--trainer-dtype",
              "float32", "--data-dir", str(tmp_path / "data")]
    runner = CliRunner()
    result = runner.invoke(cli_app, [*common, "--allowed-hosts", "a.example", "--allowed-hosts", "b.example"],
                           env={"ARTLIKE_API_KEY": ""})
    assert result.exit_code == 0, result.output
    result = runner.invoke(cli_app, common, env={"ARTLIKE_API_KEY": "", "ARTLIKE_ALLOWED_HOSTS": "c.example"})
    assert result.exit_code == 0, result.output
    assert [s.network.allowed_hosts for s in seen] == [("a.example", "b.example"), ("c.example",)]
    bad = runner.invoke(cli_app, [*common, "--allowed-hosts", "bad/name"], env={"ARTLIKE_API_KEY": ""})
    assert bad.exit_code == 2 and "--allowed-hosts" in bad.output and "not a host name" in bad.output
    star = runner.invoke(cli_app, [*common, "--allowed-hosts", "*"], env={"ARTLIKE_API_KEY": ""})
    assert star.exit_code == 0 and "WARNING: --allowed-hosts '*' without an API key" in star.output


@pytest.mark.integration
def test_the_real_server_refuses_a_rebound_page_and_its_cookie_but_not_its_key(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        assert_host_refused(http.get("/ui", headers={"Host": EVIL}))
        assert_host_refused(http.get("/ui/static/app.js", headers={"Host": EVIL}))
        port = server.base_url.rsplit(":", 1)[1]
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST.", "127.0.0.1"):
            assert http.get("/ui", headers={"Host": host}).status_code == 200, host
        logged_in = http.post("/ui/session", json={"api_key": server.api_key})
        assert logged_in.status_code == 200
        cookie = {"Cookie": f"{COOKIE}={logged_in.cookies[COOKIE]}"}
        http.cookies.clear()  # sent by hand below, and only there
        assert http.get("/v1/models", headers=cookie).status_code == 200
        assert_host_refused(http.get("/v1/models", headers=cookie | {"Host": EVIL}))
        assert http.get("/v1/models", headers=server.headers | {"Host": EVIL}).status_code == 200
        assert http.get("/v1/models", headers={"Host": EVIL}).status_code == 401
        assert http.get("/health", headers={"Host": EVIL}).json() == {"status": "ok"}
