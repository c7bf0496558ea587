"""Run `artlike serve` as a child process and wait until it is healthy: used by the demo, the examples,
the benchmarks and the integration tests, so there is one way to start and stop a server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

import httpx

from .default_model import DEFAULT_MODEL_ID
from .engine.launch import free_port

__all__ = ["ServerProcess", "ServerStartError", "free_port", "log_tail"]


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy in time; the message carries its log's tail."""


def log_tail(path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


class ServerProcess:
    """`with ServerProcess(data_dir, args=[...]) as server:` → server.base_url is healthy inside the block."""

    def __init__(
        self,
        data_dir: Path,
        *,
        args: list[str] | tuple[str, ...] = (),
        api_key: str | None = None,
        port: int | None = None,
        model_id: str = DEFAULT_MODEL_ID,
        start_timeout_s: float = 900.0,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.data_dir = data_dir
        self.args = list(args)
        self.api_key = api_key
        self.port = port or free_port()
        self.model_id = model_id
        self.start_timeout_s = start_timeout_s
        self.env = dict(env or {})  # set in the server's environment, beside this process's own
        self.log_path = data_dir / "server.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def start(self, *, wait: bool = True) -> ServerProcess:
        """Starts `artlike serve`; with `wait=False` it returns at once and `wait_healthy` waits later."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "artlike_server.cli", "serve", "--port", str(self.port),
                   "--data-dir", str(self.data_dir), *self.args]
        # The key goes in the environment, never on the command line (any local user reads /proc/*/cmdline);
        # the server keeps it out of its own children's environments.
        env = dict(os.environ, **self.env)
        if self.api_key:
            env["ARTLIKE_API_KEY"] = self.api_key
        with open(self.log_path, "ab") as log_file:
            # Its own session: stop() signals the whole group (proxy, engine, trainer) at once.
            self.process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)
        if wait:
            self.wait_healthy(self.start_timeout_s)
        return self

    def wait_healthy(self, timeout: float) -> None:
        assert self.process is not None, "start() first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerStartError(f"artlike serve exited with {self.process.returncode}:\n"
                                       f"{log_tail(self.log_path)}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(1)  # polling another process's health endpoint: nothing to await instead
        self.stop()
        raise ServerStartError(f"server not healthy after {timeout:.0f}s:\n{log_tail(self.log_path)}")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
