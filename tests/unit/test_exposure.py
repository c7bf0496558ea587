"""What `artlike serve` exposes: no open non-loopback bind, /health details only with the key, one server
per data dir. The server-side counterparts run against the real server in tests/integration/test_exposure.py."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from artlike_server.app import create_app
from artlike_server.cli import app as cli_app
from artlike_server.cli import is_loopback_host
from artlike_server.data_dir_lock import DataDirInUse, DataDirLock
from artlike_server.engine.supervisor import EngineState
from artlike_server.settings import EngineSettings, NetworkSettings, TrainerSettings
from typer.testing import CliRunner

from tests.unit.fake_services import fake_services

KEY = "health-key"


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_loopback_hosts(host: str) -> None:
    assert is_loopback_host(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "192.168.0.1", "no-such-host.invalid"])
def test_non_loopback_hosts(host: str) -> None:
    assert not is_loopback_host(host)


def serve(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli_app, ["serve", *args], env={"ARTLIKE_API_KEY": ""})
    return result.exit_code, result.output


def test_serve_refuses_a_non_loopback_host_without_an_api_key(tmp_path: Path) -> None:
    code, output = serve("--host", "0.0.0.0", "--data-dir", str(tmp_path / "data"))
    assert code == 2
    assert "refusing to serve on 0.0.0.0 without an API key" in output and "--insecure-no-api-key" in output
    assert not (tmp_path / "data").exists(), "refused before anything started"


def test_insecure_no_api_key_overrides_with_a_warning(tmp_path: Path) -> None:
    # The data dir is locked here, so the run stops right after the refusal would have happened.
    with DataDirLock(tmp_path / "data"):
        code, output = serve("--host", "0.0.0.0", "--insecure-no-api-key", "--model", str(tmp_path),
                             "--device", "cpu", "--dtype", "float32", "--trainer-dtype", "float32",
                             "--data-dir", str(tmp_path / "data"))
    assert "WARNING: serving on 0.0.0.0 without an API key" in output
    assert code == 1 and f"in use by another artlike server (process {os.getpid()})" in output


def test_the_data_dir_lock_is_exclusive_and_names_the_holder(tmp_path: Path) -> None:
    with DataDirLock(tmp_path) as held:
        assert held.path.read_text() == f"{os.getpid()}\n"
        with pytest.raises(DataDirInUse) as caught:
            DataDirLock(tmp_path).acquire()  # a second open file description: flock says no
        assert caught.value.pid == os.getpid()
        assert f"process {os.getpid()}" in str(caught.value)
    DataDirLock(tmp_path).acquire().release()  # free again once released


def health_client(api_key: str | None) -> httpx.AsyncClient:
    app = create_app(fake_services(
        network=NetworkSettings(api_key=api_key),
        engine=SimpleNamespace(state=EngineState.READY, restarts=0, pid=1234, retry_after=lambda: 0.0,
                          describe=lambda: []),
        trainer=SimpleNamespace(is_running=True, pid=5678),
        engine_settings=EngineSettings(dtype="float32", dtype_source="explicit"),
        trainer_settings=TrainerSettings(dtype="float32", dtype_source="probe"),
        models=SimpleNamespace(served_models={"secret-model@3": None}),
        training=SimpleNamespace(active=lambda: ["secret-model"]),
        sessions=SimpleNamespace(open_models=lambda: {"other-model": "ts_1"}),
        jobs=SimpleNamespace(running_jobs=lambda: ["ftjob-1"]),
        sandbox=SimpleNamespace(enforcement=lambda: {"network": "enforced (network namespace)"}),
    ))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost")


async def test_health_without_the_key_says_up_or_down_and_nothing_else() -> None:
    async with health_client(KEY) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            response = await http.get("/health", headers=headers)
            assert (response.status_code, response.json()) == (200, {"status": "ok"})


async def test_health_with_the_key_has_the_details() -> None:
    async with health_client(KEY) as http:
        body = (await http.get("/health", headers={"Authorization": f"Bearer {KEY}"})).json()
    assert body["engine"]["pid"] == 1234 and body["trainer"]["pid"] == 5678
    assert body["training"] == ["secret-model"] and body["models"] == 1
    assert body["training_sessions"] == {"other-model": "ts_1"}
    assert body["jobs"] == ["ftjob-1"] and body["sandbox"]["network"].startswith("enforced")


async def test_health_of_a_server_without_a_key_has_the_details() -> None:
    async with health_client(None) as http:
        assert (await http.get("/health")).json()["engine"]["pid"] == 1234
