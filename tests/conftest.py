"""Shared fixtures. Integration tests share ONE real server per session: `artlike serve` as a subprocess
with the real vLLM engine (float32, so outputs are exact), the real trainer, an API key turned on and
the tool-capable chat template it picks by default. Starting it is slow, so every integration
test reuses it, the security tests included (hence here, above both folders, and not in one of them).
In one process it starts as soon as collection ends, in the background, and the tests that do not need it
run first, while its engine boots; `make test` runs two workers that each take whole groups of tests
(tests/parallel.py), one of them all of this server's.

The suite's default model is a stand-in (tests/small_model.py): the embedded model cut to its first few
layers, placed where the server, the examples and the documented snippets look for the default model
(`ARTLIKE_CACHE_DIR`), so every path runs unchanged at a fraction of the cost of each pass. Tests whose
assertions need a model that answers sensibly (a tool call it chooses, a judge's verdict) use
`capable_server` instead: the same server serving the full embedded model.

Clients for it come from tests/integration/helpers.py; `http` and `async_http` are the plain-HTTP ones as
fixtures."""

from __future__ import annotations

import os
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import httpx
import pytest
from artlike_server.launcher import ServerProcess

from tests.integration.helpers import async_http_client, http_client
from tests.parallel import ServerGroupScheduling, in_parallel_run, name_the_groups_file, write_groups
from tests.small_model import use_small_default_model

TEST_API_KEY = "test-key"
# The suite runs several engines and trainers on the same two cores at once (two workers, each with its
# servers). OpenMP threads that spin while they wait for work would take a core from another process's
# working threads; passive ones sleep. The tokens are the same. (Read when torch loads: in every child, and
# here, before any test module imports torch.)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Set before anything asks for the default model: from here on, in this process and its children, the
# default model is the stand-in; FULL_CACHE_DIR is where the full one lives.
FULL_CACHE_DIR = use_small_default_model()
# No tool flags: the default server turns tool calling on by itself (tool-chatml + hermes for the default
# model), and the tool tests prove it.
# A short reward timeout: the jobs tests' reward that loops forever is killed after 3 s, not 10; a stuck
# text grader after 2 s, not 5.
SERVER_ARGS = ["--dtype", "float32", "--trainer-dtype", "float32", "--reward-timeout", "3", "--grader-timeout", "2"]


SHARED_SERVER = pytest.StashKey[ServerProcess]()
CAPABLE_SERVER = pytest.StashKey[ServerProcess]()


def uses_the_server(item: pytest.Item) -> bool:
    return "server" in getattr(item, "fixturenames", ())


def uses_the_capable_server(item: pytest.Item) -> bool:
    return "capable_server" in getattr(item, "fixturenames", ())


def server_group(item: pytest.Item) -> str:
    """The unit of work a parallel run gives one worker (tests/parallel.py)."""
    if uses_the_capable_server(item):
        return "capable-server"
    if uses_the_server(item):
        return "shared-server"
    return item.nodeid.split("::", 1)[0]


def pytest_configure(config: pytest.Config) -> None:
    name_the_groups_file(config)


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # before xdist's own loadgroup scheduling
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> ServerGroupScheduling | None:
    return ServerGroupScheduling(config, log) if in_parallel_run(config) else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `disruptive` (they crash parts of the shared server) run after all its others.

    One process: the tests without a server first (they run while the servers boot), then the capable
    server's (it stops after them), then the shared server's. In a parallel run: the shared server's group
    first, then the capable server's, then the modules that start engines of their own (integration), then
    the rest, so that the long groups start early and the short ones fill in at the end."""
    if in_parallel_run(config):
        def place(item: pytest.Item) -> tuple[int, bool]:
            own_engines = 2 if item.get_closest_marker("integration") is not None else 3
            rank = {"shared-server": 0, "capable-server": 1}.get(server_group(item), own_engines)
            return rank, item.get_closest_marker("disruptive") is not None

        items.sort(key=place)
        write_groups(items, server_group)
        return

    def alone(item: pytest.Item) -> tuple[bool, int]:
        needs = 1 if uses_the_capable_server(item) else 2 if uses_the_server(item) else 0
        return item.get_closest_marker("disruptive") is not None, needs

    items.sort(key=alone)


def start_shared_server(config: pytest.Config) -> ServerProcess:
    """Starts the shared server without waiting for it to be healthy."""
    data_dir = Path(tempfile.mkdtemp(prefix="artlike-data-"))
    # Every tracker, each writing inside the data dir (W&B offline, MLflow's file store): tests read them back.
    args = [*SERVER_ARGS, "--tensorboard-dir", str(data_dir / "tensorboard"), "--wandb-project", "artlike-tests",
            "--mlflow-tracking-uri", (data_dir / "mlruns").as_uri()]
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(data_dir), "MLFLOW_ALLOW_FILE_STORE": "true"}
    running = config.stash[SHARED_SERVER] = ServerProcess(data_dir, args=args, api_key=TEST_API_KEY, env=env)
    return running.start(wait=False)


def start_capable_server(config: pytest.Config) -> ServerProcess:
    """The same server on the full embedded model, for tests whose assertions need sensible answers."""
    data_dir = Path(tempfile.mkdtemp(prefix="artlike-capable-data-"))
    running = config.stash[CAPABLE_SERVER] = ServerProcess(
        data_dir, args=SERVER_ARGS, api_key=TEST_API_KEY, env={"ARTLIKE_CACHE_DIR": str(FULL_CACHE_DIR)})
    return running.start(wait=False)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Boots the servers as soon as the run is known to need them."""
    if session.config.option.collectonly or in_parallel_run(session.config):
        return  # a parallel run's worker boots a server when it first runs one of its tests
    if any(uses_the_capable_server(item) for item in session.items):
        start_capable_server(session.config)
    if any(uses_the_server(item) and not uses_the_capable_server(item) for item in session.items):
        start_shared_server(session.config)


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stops the capable server after its last test: its memory and cores go back to the others."""
    if uses_the_capable_server(item) and (nextitem is None or not uses_the_capable_server(nextitem)):
        running = item.config.stash.get(CAPABLE_SERVER, None)
        if running is not None:
            running.stop()


def pytest_sessionfinish(session: pytest.Session) -> None:
    for key in (SHARED_SERVER, CAPABLE_SERVER):
        running = session.config.stash.get(key, None)
        if running is not None:
            running.stop()


def healthy(config: pytest.Config, key: pytest.StashKey[ServerProcess],
            start: Callable[[pytest.Config], ServerProcess]) -> Iterator[ServerProcess]:
    """The server booted at collection's end (or now, if it was not), once healthy; stopped afterwards."""
    running = config.stash.get(key, None) or start(config)
    try:
        running.wait_healthy(running.start_timeout_s)
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="session")
def server(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    """A real server: `.base_url`, `.model_id`, `.api_key`, `.headers`, `.data_dir`, `.process`, `.log_path`."""
    yield from healthy(request.config, SHARED_SERVER, start_shared_server)


@pytest.fixture(scope="session")
def capable_server(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    """Like `server`, serving the full embedded model; a module whose assertions need it (tool calls the model
    chooses, a judge's JSON) overrides its `server` fixture with this one."""
    yield from healthy(request.config, CAPABLE_SERVER, start_capable_server)


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    """Plain HTTP to the session's server with its key; paths relative to its base URL."""
    with http_client(server) as client:
        yield client


@pytest.fixture(scope="module")
async def async_http(server: ServerProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with async_http_client(server) as client:
        yield client
