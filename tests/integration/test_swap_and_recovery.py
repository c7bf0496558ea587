"""Serving never fails because of a swap, and a crashed engine comes back with every adapter."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid

import httpx
import openai
import pytest
from artlike_server.launcher import ServerProcess

from tests.integration.engine_helpers import engine_processes, still_running
from tests.integration.test_training import (
    assert_same_output,
    greedy_probe,
    health,
    register,
    rollout_groups,
    train_lines,
)

from .helpers import async_openai_client

pytestmark = pytest.mark.integration


async def test_swap_mid_traffic_fails_no_request(server: ServerProcess) -> None:
    name = "busy"
    register(server, name)
    groups = rollout_groups(server, name)
    client = async_openai_client(server, timeout=300)
    served: list[str] = []
    failures: list[BaseException] = []
    stop = asyncio.Event()
    new_step_served = asyncio.Event()

    async def traffic() -> None:
        while not stop.is_set():
            try:
                completion = await client.chat.completions.create(
                    model=name, messages=[{"role": "user", "content": "Hello!"}], max_tokens=8)
                served.append(completion.model)
                if completion.model == f"{name}@1":
                    new_step_served.set()
            except openai.APIError as error:
                failures.append(error)

    workers = [asyncio.create_task(traffic()) for _ in range(4)]
    body = {"model": name, "groups": groups, "config": {"learning_rate": 1e-3}}
    lines = await asyncio.to_thread(train_lines, server, body)
    assert lines[-1][1]["type"] == "done"
    await asyncio.wait_for(new_step_served.wait(), timeout=120)  # traffic reaches the new step
    stop.set()
    await asyncio.gather(*workers)
    await client.close()
    assert failures == []
    assert f"{name}@0" in served and f"{name}@1" in served
    first_new = served.index(f"{name}@1")
    assert set(served[first_new:]) <= {f"{name}@0", f"{name}@1"}


def wait_for_status(server: ServerProcess, statuses: tuple[str, ...], *, within_s: float) -> bool:
    """Whether /health reports one of `statuses` within `within_s` seconds (polled)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if health(server)["status"] in statuses:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.disruptive
def test_engine_crash_gives_503_then_recovers_with_adapters(server: ServerProcess) -> None:
    name = "phoenix"
    register(server, name)
    train_lines(server, {"model": name, "groups": rollout_groups(server, name),
                         "config": {"learning_rate": 2e-3, "max_grad_norm": 10.0}})
    expected = greedy_probe(server, name)
    engine_pid = health(server)["engine"]["pid"]
    killed = engine_processes(engine_pid)  # the API server and its EngineCore
    os.kill(engine_pid, signal.SIGKILL)

    saw_503 = saw_restart = False
    deadline = time.monotonic() + 600
    body = {"model": name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    while time.monotonic() < deadline:
        response = httpx.post(f"{server.base_url}/t/{uuid.uuid4().hex}/v1/chat/completions", json=body,
                              headers=server.headers, timeout=60)
        if response.status_code == 503:
            saw_503 = True
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert int(response.headers["retry-after"]) >= 1
            if not saw_restart:  # the proxy may see the dead engine a moment before the supervisor does
                saw_restart = wait_for_status(server, ("restarting", "starting"), within_s=15)
        elif response.status_code == 200:
            if saw_503:
                break
        else:
            pytest.fail(f"unexpected {response.status_code}: {response.text}")
        time.sleep(1)  # polling a restarting engine from outside: nothing to await instead
    assert saw_503, "the proxy never reported the engine as unavailable"
    assert saw_restart, "/health never reported the engine restarting"
    state = health(server)
    assert state["status"] == "ok" and state["engine"]["restarts"] >= 1 and state["engine"]["pid"] != engine_pid
    assert still_running(killed) == [], "the killed engine's EngineCore must not outlive it"
    assert_same_output(greedy_probe(server, name), expected)  # the trained step was re-loaded after the restart
    metrics = httpx.get(f"{server.base_url}/metrics", headers=server.headers).text
    assert "artlike_engine_restarts" in metrics
