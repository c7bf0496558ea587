"""vLLM plugin: on CPU, the engine core process is forked from the API server instead of spawned.

vLLM's CPU platform sets `VLLM_WORKER_MULTIPROC_METHOD=spawn` whenever it checks a configuration, so the
engine core starts as a fresh interpreter that imports torch, transformers and vLLM again, although the API
server process that starts it has just imported them: one interpreter's imports, a large part of an
engine's start on a small CPU. Fork is what vLLM does on GPU (where the API server never touches the
device); it is safe here for the same reason: the API server process runs no model, so there is no
OpenMP team and no device context to inherit, and the engine core binds its own OpenMP threads to its
cores after it starts (`cpu_worker`). Tokens are the same either way (tests/integration/test_engine.py
runs on a forked core; `bench/engine_start.py` compares the starts).

Opt-in: only an engine started with `ARTLIKE_ENGINE_CORE_START=fork` in its environment (the launcher sets
it for the engines it starts on CPU; see `launch.build_env`), and only for one rank: a tensor-parallel
engine's workers are left to vLLM's spawn. vLLM calls `register()` in each of its processes through the
documented `vllm.general_plugins` entry point `artlike_core_fork` (pyproject.toml).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from artlike_server.engine.plugin_log import visible_logger

logger = logging.getLogger("vllm.plugins.artlike_core_fork")

START_ENV = "ARTLIKE_ENGINE_CORE_START"
_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"
_WRAPPED = "_artlike_keeps_fork"


def register() -> None:
    """Entry point called by vLLM in each of its processes; idempotent."""
    if os.environ.get(START_ENV) != "fork":
        return
    from vllm.platforms.cpu import CpuPlatform

    check = CpuPlatform.check_and_update_config  # a classmethod, bound to CpuPlatform
    if getattr(check, _WRAPPED, False):
        return
    original = getattr(check, "__func__")  # noqa: B009 (the function under the classmethod)

    def check_and_update_config(cls: type[Any], vllm_config: Any) -> None:
        original(cls, vllm_config)
        if vllm_config.parallel_config.world_size == 1:
            os.environ[_METHOD_ENV] = "fork"
            visible_logger(logger.name).info("artlike: the engine core starts by fork (one rank on CPU)")

    setattr(check_and_update_config, _WRAPPED, True)
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[method-assign,assignment]
