"""Shared fixtures. Integration tests share ONE real server per session: `artlike serve` as a subprocess
with the real vLLM engine (float32, so outputs are exact), the real trainer, an API key turned on and
the tool-capable chat template. Starting it costs ~1 minute, so every integration test reuses it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

SERVER_START_TIMEOUT_S = 900


@dataclass(frozen=True)
class RunningServer:
    base_url: str
    model_id: str
    api_key: str
    data_dir: Path
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def http(self, **kwargs: object) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers=self.headers, timeout=300, **kwargs)  # type: ignore[arg-type]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(data_dir: Path, *, api_key: str, extra: list[str] | None = None) -> RunningServer:
    from artlike_server.default_model import DEFAULT_MODEL_ID

    port = free_port()
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = data_dir / "server.log"
    command = [
        sys.executable, "-m", "artlike_server.cli", "serve",
        "--port", str(port), "--data-dir", str(data_dir), "--api-key", api_key,
        "--dtype", "float32", "--trainer-dtype", "float32",
        "--chat-template", "tool-chatml", "--tool-call-parser", "hermes",
        *(extra or []),
    ]
    with open(log_path, "ab") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    server = RunningServer(f"http://127.0.0.1:{port}", DEFAULT_MODEL_ID, api_key, data_dir, process, log_path)
    wait_healthy(server, SERVER_START_TIMEOUT_S)
    return server


def wait_healthy(server: RunningServer, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"artlike serve exited with {server.process.returncode}:\n{tail(server.log_path)}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)  # polling a subprocess's health endpoint: there is nothing to wait on instead
    stop_server(server)
    raise TimeoutError(f"server not healthy after {timeout}s:\n{tail(server.log_path)}")


def stop_server(server: RunningServer) -> None:
    if server.process.poll() is None:
        os.killpg(server.process.pid, signal.SIGTERM)
        try:
            server.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.process.pid, signal.SIGKILL)
            server.process.wait()


def tail(path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(tmp_path_factory.mktemp("artlike-data"), api_key="test-key")
    try:
        yield running
    finally:
        stop_server(running)
