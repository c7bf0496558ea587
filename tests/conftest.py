"""Shared fixtures. Integration tests share ONE real server per session: `artlike serve` as a subprocess
with the real vLLM engine (float32, so outputs are exact), the real trainer, an API key turned on and
the tool-capable chat template it picks by default. Starting it is slow, so every integration
test reuses it, the security tests included (hence here, above both folders, and not in one of them).

Clients for it come from tests/integration/helpers.py; `http` and `async_http` are the plain-HTTP ones as
fixtures."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from artlike_server.launcher import ServerProcess

from tests.integration.helpers import async_http_client, http_client

TEST_API_KEY = "test-key"
# No tool flags: the default server turns tool calling on by itself (tool-chatml + hermes for the default
# model), and the tool tests prove it.
# A short reward timeout: the jobs tests' reward that loops forever is killed after 3 s, not 10; a stuck
# text grader after 2 s, not 5.
SERVER_ARGS = ["--dtype", "float32", "--trainer-dtype", "float32", "--reward-timeout", "3", "--grader-timeout", "2"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked `disruptive` (they crash parts of the shared server) run after all the others."""
    items.sort(key=lambda item: item.get_closest_marker("disruptive") is not None)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A real server: `.base_url`, `.model_id`, `.api_key`, `.headers`, `.data_dir`, `.process`, `.log_path`."""
    data_dir = tmp_path_factory.mktemp("artlike-data")
    args = [*SERVER_ARGS, "--tensorboard-dir", str(data_dir / "tensorboard")]
    with ServerProcess(data_dir, args=args, api_key=TEST_API_KEY) as running:
        yield running


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    """Plain HTTP to the session's server with its key; paths relative to its base URL."""
    with http_client(server) as client:
        yield client


@pytest.fixture(scope="module")
async def async_http(server: ServerProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with async_http_client(server) as client:
        yield client
