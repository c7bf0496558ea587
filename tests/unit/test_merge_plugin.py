"""The `artlike_merge` vLLM plugin registers the policy engine's weight-transfer backend (engine/merge_plugin.py)."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

from artlike_server.engine import merge_plugin


def test_the_entry_point_vllm_loads_is_register() -> None:
    (entry_point,) = [ep for ep in importlib.metadata.entry_points(group="vllm.general_plugins")
                      if ep.name == "artlike_merge"]
    assert entry_point.load() is merge_plugin.register


def test_register_makes_the_backend_available_once() -> None:
    # In a fresh interpreter: the factory's registry is process-wide. Twice, as vLLM may call it twice.
    check = """
from artlike_server.engine import merge_plugin
from artlike_server.engine.merge_transfer import AdapterMergeTransfer
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
merge_plugin.register()
merge_plugin.register()
assert WeightTransferEngineFactory._registry["artlike_merge"]() is AdapterMergeTransfer
"""
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
