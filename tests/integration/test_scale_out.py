"""Scale-out against real engines. One proxy in front of two local vLLM engines it supervises
(`--engines 2`: one core each). Through the official `openai` SDK and plain HTTP:

- traffic spreads across both engines; a trajectory's requests stay on one engine;
- a trained step reaches both before the alias moves (greedy outputs after the swap are the same on both
  engines, and differ from the base model's);
- killing one engine while requests are in flight fails none of the non-streaming ones (they are sent
  again to the other engine), and the restarted engine rejoins with the kept steps loaded.

Then an external vLLM server (started here as an operator would, with its own key) behind a proxy that
runs no engine of its own (`--engines 0 --engine-url`): it serves, it receives the adapters, and a wrong
key is refused at start.

The unit tests (tests/unit/test_engine_pool.py) cover the rules this cannot provoke cheaply (a refused
load, a remote engine that forgets its adapters, every engine down).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from artlike_server.default_model import DEFAULT_MODEL_ID, ensure_default_model
from artlike_server.engine.launch import EngineConfig, build_command, build_env, free_port
from artlike_server.engine.tool_calling import choose_tool_calling
from artlike_server.launcher import ServerProcess, ServerStartError, log_tail

from tests.conftest import SERVER_ARGS, TEST_API_KEY
from tests.integration.test_training import LOGPROB_TOLERANCE, health, register, rollout_groups, train_lines

from .helpers import openai_client

pytestmark = pytest.mark.integration

EXTERNAL_KEY = "external-engine-key"
PROBE = [{"role": "user", "content": "Write one sentence about rivers."}]
# Every engine this module starts holds 0.5 GiB of KV cache, not the default 1 GiB: three engines beside the
# session's server leave the machine memory to spare. (vLLM refuses to start with less KV cache than one
# request of the model's whole context needs: 8,192 tokens x 45 KB for SmolLM2-135M in float32, 0.35 GiB.)
SMALL_KV_CACHE_GIB = 0.5


def engines(server: ServerProcess) -> dict[str, dict[str, Any]]:
    return {engine["id"]: engine for engine in health(server)["engines"]}


def wait_for(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.5)  # polling another process's /health: nothing to await instead
    raise AssertionError(f"not within {timeout:.0f}s: {what}")


def both_serving(server: ServerProcess) -> bool:
    return all(engine["serving"] for engine in engines(server).values())


class ExternalEngine:
    """The operator's engine process: `ready()` waits for it to serve and returns its URL, or fails at once,
    with its log, if it exited (rather than leaving a proxy to wait out its start-up timeout for it)."""

    def __init__(self, process: subprocess.Popen[bytes], base_url: str, log_path: Path) -> None:
        self.process, self.base_url, self.log_path = process, base_url, log_path

    def ready(self, timeout: float = 600) -> str:
        wait_for(self._serving, timeout, "the external engine serving")
        return self.base_url

    def _serving(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"the external engine exited ({self.process.returncode}):\n{log_tail(self.log_path)}")
        try:
            return httpx.get(f"{self.base_url}/health", timeout=5).status_code == 200
        except httpx.TransportError:
            return False  # not listening yet


@pytest.fixture(scope="module")
def external_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ExternalEngine]:
    """A vLLM OpenAI server as someone else would run it: same weights, name, template and dtype as the
    proxy's own engine would have, runtime LoRA on, its own key. Not waited for here: its tests call
    `ready()`. Half a GiB of KV cache (these tests send a few short requests): at this point the session's
    server and the pool's two engines hold memory too, and an engine that finds too little at start exits."""
    model_dir = ensure_default_model()
    tools = choose_tool_calling(model_dir)
    log_path = tmp_path_factory.mktemp("external") / "engine.log"
    config = EngineConfig(model_path=model_dir, served_model_name=DEFAULT_MODEL_ID, port=free_port(),
                          log_path=log_path, dtype="float32", chat_template=tools.chat_template,
                          tool_call_parser=tools.parser, kv_cache_gib=SMALL_KV_CACHE_GIB)
    with open(log_path, "ab") as log:
        process = subprocess.Popen(build_command(config, sys.executable),
                                   env=build_env(config, os.environ, api_key=EXTERNAL_KEY),
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield ExternalEngine(process, config.base_url, log_path)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture(scope="module")
def pool_server(tmp_path_factory: pytest.TempPathFactory, external_engine: ExternalEngine) -> Iterator[ServerProcess]:
    """Two local engines. (`external_engine` only boots meanwhile, idle until the last tests use it: its
    start-up overlaps the pool's instead of adding to the suite's time.)"""
    data_dir = tmp_path_factory.mktemp("scale-out")
    args = [*SERVER_ARGS, "--engines", "2", "--kv-cache-gib", str(SMALL_KV_CACHE_GIB)]
    with ServerProcess(data_dir, args=args, api_key=TEST_API_KEY) as running:
        wait_for(lambda: both_serving(running), 600, "both engines serving")
        yield running


def chat(server: ServerProcess, model: str, *, trajectory_id: str | None = None, max_tokens: int = 8,
         messages: list[dict[str, str]] | None = None, **extra: Any) -> Any:
    with openai_client(server, trajectory_id, timeout=300) as client:
        return client.chat.completions.create(model=model, messages=messages or PROBE, max_tokens=max_tokens,
                                              temperature=0.0, logprobs=True, **extra)


def served_by(server: ServerProcess, request: Any) -> str:
    """Run `request()` alone and say which engine's request count went up."""
    before = {name: engine["requests"] for name, engine in engines(server).items()}
    request()
    after = {name: engine["requests"] for name, engine in engines(server).items()}
    moved = [name for name in after if after[name] > before[name]]
    assert len(moved) == 1, (before, after)
    return moved[0]


def probe_outputs(server: ServerProcess, model: str, count: int) -> list[tuple[str, list[float]]]:
    """`count` concurrent greedy probes (so both engines get some); their text and logprobs."""
    def one(_: int) -> tuple[str, list[float]]:
        completion = chat(server, model, max_tokens=12)
        choice = completion.choices[0]
        return choice.message.content or "", [t.logprob for t in choice.logprobs.content]

    with ThreadPoolExecutor(max_workers=count) as pool:
        return list(pool.map(one, range(count)))


def same(a: tuple[str, list[float]], b: tuple[str, list[float]]) -> bool:
    return a[0] == b[0] and len(a[1]) == len(b[1]) and all(
        abs(x - y) <= LOGPROB_TOLERANCE for x, y in zip(a[1], b[1], strict=True))


def train_one_step(server: ServerProcess, name: str) -> dict[str, Any]:
    """Train `name` one step on 2 groups of 4 fresh rollouts; returns the `done` line. Rewards go by position:
    two samples of equal length would leave a group without signal. Four a group, not two: a pair can sample
    the same 8 tokens, and identical samples' gradients cancel (seen once in a fresh-clone run, when both
    pairs did: a step that left the greedy output unchanged)."""
    groups = rollout_groups(server, name, groups=2, size=4, max_tokens=8)
    for group in groups:
        for index, trajectory in enumerate(group["trajectories"]):
            trajectory["reward"] = float(index)
    lines = train_lines(server, {"model": name, "groups": groups, "config": {"learning_rate": 5e-3}})
    assert lines[-1][1]["type"] == "done", lines[-1]
    return lines[-1][1]


def test_health_and_metrics_show_each_engine(pool_server: ServerProcess) -> None:
    listed = engines(pool_server)
    assert set(listed) == {"local-0", "local-1"}
    assert all(engine["kind"] == "local" and engine["pid"] is not None for engine in listed.values())
    assert listed["local-0"]["pid"] != listed["local-1"]["pid"]
    # Each engine's threads are bound to its own core (the split of this machine's cores).
    binds = [psutil.Process(engine["pid"]).environ()["VLLM_CPU_OMP_THREADS_BIND"] for engine in listed.values()]
    assert len(set(binds)) == 2, binds
    metrics = httpx.get(f"{pool_server.base_url}/metrics", headers=pool_server.headers, timeout=30).text
    assert 'artlike_engine_serving{engine="local-0"} 1.0' in metrics
    assert 'artlike_engine_serving{engine="local-1"} 1.0' in metrics


def test_traffic_spreads_and_a_trajectory_stays_on_one_engine(pool_server: ServerProcess) -> None:
    before = {name: engine["requests"] for name, engine in engines(pool_server).items()}
    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = list(pool.map(lambda _: chat(pool_server, DEFAULT_MODEL_ID), range(8)))
    assert all(answer.choices[0].message.content for answer in answers)
    after = {name: engine["requests"] for name, engine in engines(pool_server).items()}
    assert all(after[name] > before[name] for name in after), (before, after)  # both engines served some

    homes = set()
    for _ in range(2):
        trajectory = uuid.uuid4().hex
        turns = {served_by(pool_server, lambda t=trajectory: chat(pool_server, DEFAULT_MODEL_ID, trajectory_id=t))
                 for _ in range(3)}
        assert len(turns) == 1, turns  # every turn of the trajectory on the engine that served its first
        homes |= turns
    assert homes == {"local-0", "local-1"}  # the second trajectory went to the engine the first left idle


def test_a_trained_step_reaches_both_engines_and_survives_a_killed_engine(pool_server: ServerProcess) -> None:
    name = "scaled"
    register(pool_server, name)
    base_output = probe_outputs(pool_server, DEFAULT_MODEL_ID, 1)[0]
    train_one_step(pool_server, name)
    before = {n: e["requests"] for n, e in engines(pool_server).items()}
    outputs = probe_outputs(pool_server, name, 6)
    after = {n: e["requests"] for n, e in engines(pool_server).items()}
    assert all(after[n] > before[n] for n in after), (before, after)  # both engines served the new step...
    assert all(same(output, outputs[0]) for output in outputs), outputs  # ...with the same weights
    assert not same(outputs[0], base_output)  # and they are the trained step's, not the base model's

    # Kill one engine while non-streaming requests are in flight on it: each is sent again.
    local = engines(pool_server)["local-1"]
    failures_before = local["failures"]

    def long_request(_: int) -> int:
        completion = chat(pool_server, name, max_tokens=48, extra_body={"ignore_eos": True},
                          messages=[{"role": "user", "content": "Count slowly from one to fifty."}])
        return len(completion.choices[0].logprobs.content)

    with ThreadPoolExecutor(max_workers=6) as pool:
        futures = [pool.submit(long_request, i) for i in range(6)]
        wait_for(lambda: engines(pool_server)["local-1"]["outstanding"] >= 1, 60, "requests on the engine")
        os.killpg(local["pid"], signal.SIGKILL)
        lengths = [future.result() for future in futures]  # raises if any request failed
    assert lengths == [48] * 6
    assert engines(pool_server)["local-1"]["failures"] > failures_before  # the failover path really ran

    # The supervisor restarts it; it rejoins with the kept step loaded before it takes traffic.
    wait_for(lambda: engines(pool_server)["local-1"]["restarts"] >= 1 and engines(pool_server)["local-1"]["serving"],
             600, "the killed engine back in the rotation")
    before = {n: e["requests"] for n, e in engines(pool_server).items()}
    again = probe_outputs(pool_server, name, 6)
    after = {n: e["requests"] for n, e in engines(pool_server).items()}
    assert after["local-1"] > before["local-1"]
    assert all(same(output, outputs[0]) for output in again), again


def test_an_external_engine_serves_and_gets_the_adapters(tmp_path: Path, pool_server: ServerProcess,
                                                         external_engine: ExternalEngine) -> None:
    pool_server.stop()  # two engines on two cores at most: the pool's are done
    external_url = external_engine.ready()
    args = [*SERVER_ARGS, "--engines", "0", "--engine-url", f"{external_url}/v1", "--engine-key", EXTERNAL_KEY]
    with ServerProcess(tmp_path / "remote-only", args=args, api_key=TEST_API_KEY) as server:
        listed = engines(server)
        assert list(listed) == ["remote-0"] and listed["remote-0"]["url"] == external_url  # /v1 dropped
        assert listed["remote-0"]["kind"] == "remote" and listed["remote-0"]["pid"] is None
        register(server, "far")
        completion = chat(server, "far", trajectory_id=uuid.uuid4().hex)
        assert completion.model == "far@0" and completion.choices[0].logprobs.content
        # The adapter was loaded by the path the proxy sent (a shared filesystem: here, the same machine).
        with httpx.Client(base_url=external_url, headers={"Authorization": f"Bearer {EXTERNAL_KEY}"}) as http:
            models = {m["id"]: m for m in http.get("/v1/models", timeout=30).json()["data"]}
        assert models["far@0"]["root"] == str(tmp_path / "remote-only" / "models" / "far" / "steps" / "0")
        assert engines(server)["remote-0"]["requests"] >= 1


def test_a_misconfigured_external_engine_is_refused_at_start(tmp_path: Path, external_engine: ExternalEngine) -> None:
    """A wrong key for the only engine: the server says so and exits instead of serving nothing."""
    external_url = external_engine.ready()
    args = [*SERVER_ARGS, "--engines", "0", "--engine-url", external_url, "--engine-key", "wrong"]
    with pytest.raises(ServerStartError, match="is --engine-key right"), \
            ServerProcess(tmp_path, args=args, api_key=TEST_API_KEY, start_timeout_s=300):
        pass
