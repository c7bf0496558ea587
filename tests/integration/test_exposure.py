"""Who can drive the server and its engine, and how it stops: against the real server.

The shared `server` fixture answers the engine and second-server tests. How a SIGTERM stops it mid-training
is in test_restart.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from artlike_server.launcher import ServerProcess, free_port

from tests.conftest import SERVER_ARGS
from tests.integration.test_training import health

pytestmark = pytest.mark.integration


def engine_port(server: ServerProcess) -> int:
    """The port of the engine's latest start, from the command line the supervisor logs."""
    starts = re.findall(r"starting vLLM: .* --port (\d+)", (Path(server.data_dir) / "logs" / "engine.log").read_text())
    return int(starts[-1])


def serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "ARTLIKE_API_KEY"}
    return subprocess.run([sys.executable, "-m", "artlike_server.cli", "serve", *args], env=env, timeout=timeout,
                          capture_output=True, text=True)


def test_the_engine_refuses_every_request_without_its_key(server: ServerProcess) -> None:
    engine = f"http://127.0.0.1:{engine_port(server)}"
    assert httpx.get(f"{engine}/health", timeout=30).status_code == 200  # the supervisor's probe stays open
    load = {"lora_name": "intruder", "lora_path": str(server.data_dir)}
    assert httpx.post(f"{engine}/v1/load_lora_adapter", json=load, timeout=30).status_code == 401
    assert httpx.get(f"{engine}/v1/models", timeout=30).status_code == 401
    # vLLM's own --api-key leaves this one open: it runs any generation.
    invocation = {"model": server.model_id, "prompt": "Hi", "max_tokens": 1}
    assert httpx.post(f"{engine}/invocations", json=invocation, timeout=30).status_code == 401

    # The key lives only in the engine's environment (readable by this same user, not on its command line).
    process = psutil.Process(health(server)["engine"]["pid"])
    environ = process.environ()
    key = environ["VLLM_API_KEY"]
    assert key not in " ".join(process.cmdline()) and key != server.api_key
    assert "VLLM_SERVER_DEV_MODE" not in environ
    with httpx.Client(base_url=engine, headers={"Authorization": f"Bearer {key}"}, timeout=30) as http:
        assert http.get("/v1/models").status_code == 200
        assert http.post("/collective_rpc", json={"method": "get_model"}).status_code == 404  # no dev mode


def test_health_without_the_key_says_up_and_nothing_else(server: ServerProcess) -> None:
    response = httpx.get(f"{server.base_url}/health", timeout=30)
    assert (response.status_code, response.json()) == (200, {"status": "ok"})
    assert health(server)["engine"]["pid"] > 0  # with the key: the details


def test_a_second_server_on_the_same_data_dir_exits_at_once_naming_the_first(server: ServerProcess) -> None:
    started = time.monotonic()
    second = serve("--data-dir", str(server.data_dir), "--port", str(free_port()), *SERVER_ARGS)
    assert second.returncode == 1, second.stderr
    assert f"in use by another artlike server (process {server.process.pid})" in second.stderr
    assert time.monotonic() - started < 60  # refused before any engine started
    assert health(server)["status"] == "ok"


def test_a_non_loopback_bind_without_an_api_key_is_refused(tmp_path: Path) -> None:
    refused = serve("--host", "0.0.0.0", "--port", str(free_port()), "--data-dir", str(tmp_path))
    assert refused.returncode == 2
    assert "refusing to serve on 0.0.0.0 without an API key" in refused.stderr
