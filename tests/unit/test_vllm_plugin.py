"""The vLLM plugin that keeps base-model rows of a mixed LoRA batch free of adapters (no engine needed)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
from artlike_server.engine import vllm_plugin

lora_ops = pytest.importorskip("vllm.lora.ops.torch_ops.lora_ops")

# Rows 1 and 4 have no adapter (-1); three slots, so vLLM's -1 reads slot 2.
SLOTS = torch.tensor([0, -1, 2, 1, -1, 2])
NO_ADAPTER = SLOTS < 0
ROWS, IN, RANK, OUT, NUM_SLOTS = len(SLOTS), 16, 4, 24, 3


def random(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def shrink(fn: Callable[..., None]) -> torch.Tensor:
    out = torch.full((ROWS, RANK), 7.0)
    fn(random(ROWS, IN, seed=1), random(NUM_SLOTS, 1, RANK, IN, seed=2), out, SLOTS, 0.5)
    return out


def expand(fn: Callable[..., None], add_inputs: bool) -> torch.Tensor:
    out = random(ROWS, OUT, seed=3)
    fn(random(ROWS, RANK, seed=4), random(NUM_SLOTS, 1, OUT, RANK, seed=5), out, SLOTS, add_inputs)
    return out


def expand_slice(fn: Callable[..., None], add_inputs: bool) -> torch.Tensor:
    out = random(ROWS, OUT, seed=3)
    fn(random(ROWS, RANK, seed=4), random(NUM_SLOTS, 1, 8, RANK, seed=5), out, SLOTS, 4, 8, add_inputs)
    return out


def test_shrink_matches_vllm_on_adapter_rows_and_gives_zero_without_adapter() -> None:
    ours, theirs = shrink(vllm_plugin.bgmv_shrink), shrink(lora_ops.bgmv_shrink)
    torch.testing.assert_close(ours[~NO_ADAPTER], theirs[~NO_ADAPTER])  # a matmul per adapter, not an einsum per row
    assert torch.equal(ours[NO_ADAPTER], torch.zeros(2, RANK))
    assert theirs[NO_ADAPTER].abs().sum() > 0, "vLLM 0.32's own kernel applies the last slot (the bug)"


@pytest.mark.parametrize("add_inputs", [True, False])
def test_expand_matches_vllm_on_adapter_rows_and_adds_nothing_without_adapter(add_inputs: bool) -> None:
    before = random(ROWS, OUT, seed=3)
    ours, theirs = expand(vllm_plugin.bgmv_expand, add_inputs), expand(lora_ops.bgmv_expand, add_inputs)
    torch.testing.assert_close(ours[~NO_ADAPTER], theirs[~NO_ADAPTER])  # a matmul per adapter, not an einsum per row
    expected = before[NO_ADAPTER] if add_inputs else torch.zeros(2, OUT)
    assert torch.equal(ours[NO_ADAPTER], expected)


@pytest.mark.parametrize("add_inputs", [True, False])
def test_expand_slice_touches_only_its_slice_and_nothing_without_adapter(add_inputs: bool) -> None:
    before = random(ROWS, OUT, seed=3)
    ours = expand_slice(vllm_plugin.bgmv_expand_slice, add_inputs)
    theirs = expand_slice(lora_ops.bgmv_expand_slice, add_inputs)
    torch.testing.assert_close(ours[~NO_ADAPTER], theirs[~NO_ADAPTER])  # a matmul per adapter, not an einsum per row
    outside = torch.ones(OUT, dtype=torch.bool)
    outside[4:12] = False
    assert torch.equal(ours[:, outside], before[:, outside])
    expected = before[NO_ADAPTER][:, 4:12] if add_inputs else torch.zeros(2, 8)
    assert torch.equal(ours[NO_ADAPTER][:, 4:12], expected)


@pytest.mark.parametrize("slot", [1, -1])
def test_a_batch_on_one_slot_matches_vllm_or_gives_zero(slot: int) -> None:
    slots = torch.full((ROWS,), slot)
    inputs, weights = random(ROWS, IN, seed=1), random(NUM_SLOTS, 1, RANK, IN, seed=2)
    ours, theirs = torch.full((ROWS, RANK), 7.0), torch.full((ROWS, RANK), 7.0)
    vllm_plugin.bgmv_shrink(inputs, weights, ours, slots, 0.5)
    lora_ops.bgmv_shrink(inputs, weights, theirs, slots, 0.5)
    if slot >= 0:
        torch.testing.assert_close(ours, theirs)
    else:
        assert torch.equal(ours, torch.zeros(ROWS, RANK))


def test_the_probe_tells_a_buggy_kernel_from_a_fixed_one() -> None:
    assert vllm_plugin.no_adapter_row_leaks(lora_ops)
    assert not vllm_plugin.no_adapter_row_leaks(SimpleNamespace(bgmv_shrink=vllm_plugin.bgmv_shrink))  # type: ignore[arg-type]


def test_the_plugin_targets_the_pinned_vllm() -> None:
    import vllm

    assert vllm.__version__.startswith("0.32.")


def test_the_entry_point_vllm_loads_is_register() -> None:
    (entry_point,) = [
        ep
        for ep in importlib.metadata.entry_points(group="vllm.general_plugins")
        if ep.name == "artlike_lora_fix"
    ]
    assert entry_point.load() is vllm_plugin.register


# register() patches vLLM modules process-wide, so it runs in a fresh interpreter.
REGISTER_CHECK = """
import vllm.lora.punica_wrapper.punica_cpu as punica_cpu
from vllm.lora.ops import torch_ops
from vllm.lora.ops.torch_ops import lora_ops
from artlike_server.engine import vllm_plugin
vllm_plugin.register()
vllm_plugin.register()  # idempotent
patched = [m.bgmv_expand is vllm_plugin.bgmv_expand for m in (lora_ops, torch_ops, punica_cpu)]
print(patched, vllm_plugin.no_adapter_row_leaks(lora_ops))
"""


def run_register_check(**env: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", REGISTER_CHECK],
        env=os.environ | env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


def test_register_patches_every_namespace_once() -> None:
    assert run_register_check() == "[True, True, True] False"


def test_register_can_be_turned_off() -> None:
    assert run_register_check(ARTLIKE_DISABLE_VLLM_PLUGIN="1") == "[False, False, False] True"
