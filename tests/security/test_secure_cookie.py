"""Behind a TLS-terminating proxy the studio page's session cookie is `Secure`: `artlike serve
--forwarded-allow-ips` makes uvicorn trust that proxy's `X-Forwarded-Proto`, and an https request then gets
a cookie the browser never sends over plain http. Without the option the header is not trusted."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import uvicorn
from artlike_server import cli
from artlike_server.settings import NetworkSettings, ServerSettings
from artlike_server.studio.page_logins import COOKIE, PageLogins
from typer.testing import CliRunner

from tests.unit.fake_services import fake_services

KEY = "cookie-key"


def served_app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, forwarded_allow_ips: str | None) -> uvicorn.Config:
    """The uvicorn config `artlike serve` runs (the real app and middleware stack), stopped before it listens."""
    configs: list[uvicorn.Config] = []
    monkeypatch.setattr(cli._Server, "run", lambda self, sockets=None: configs.append(self.config))
    settings = ServerSettings(model_path=tmp_path, served_model_name="base", data_dir=tmp_path,
                              network=NetworkSettings(api_key=KEY, forwarded_allow_ips=forwarded_allow_ips))
    cli._serve(settings, "warning")
    config = configs[0]
    config.load()
    # The lifespan does not run here: the page's log-in route needs only these.
    config.app.state.artlike = fake_services(network=settings.network, page_logins=PageLogins(api_key=KEY))
    return config


async def log_in(config: uvicorn.Config, client: str, headers: dict[str, str]) -> str:
    transport = httpx.ASGITransport(app=config.loaded_app, client=(client, 50000))
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as http:
        response = await http.post("/ui/session", json={"api_key": KEY}, headers=headers)
    assert response.status_code == 200, response.text
    cookie = response.headers["set-cookie"]
    assert cookie.startswith(f"{COOKIE}=") and "HttpOnly" in cookie and "SameSite=strict" in cookie
    return cookie


async def test_https_through_a_trusted_proxy_gets_a_secure_cookie(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    config = served_app(tmp_path, monkeypatch, "127.0.0.1")
    https = {"X-Forwarded-Proto": "https", "X-Forwarded-For": "203.0.113.7"}
    assert "Secure" in await log_in(config, "127.0.0.1", https)
    assert "Secure" not in await log_in(config, "127.0.0.1", {"X-Forwarded-Proto": "http"})
    assert "Secure" not in await log_in(config, "10.9.9.9", https), "only the listed proxy is trusted"


async def test_without_the_option_forwarded_headers_are_ignored(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORWARDED_ALLOW_IPS", "*")  # uvicorn's own default must not turn trust on either
    config = served_app(tmp_path, monkeypatch, None)
    assert "Secure" not in await log_in(config, "127.0.0.1", {"X-Forwarded-Proto": "https"})


def test_serve_passes_the_option_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[ServerSettings] = []
    monkeypatch.setattr("artlike_server.cli.run", lambda settings, **_: seen.append(settings) or 0)
    result = CliRunner().invoke(cli.app, ["serve", "--model", str(tmp_path), "--device", "cpu", "--dtype", "float32",
                                          "--trainer-dtype", "float32", "--data-dir", str(tmp_path / "d"),
                                          "--forwarded-allow-ips", "127.0.0.1,10.0.0.2"],
                                env={"ARTLIKE_API_KEY": ""})
    assert result.exit_code == 0, result.output
    assert seen[0].network.forwarded_allow_ips == "127.0.0.1,10.0.0.2"
