"""vLLM plugin: base-model rows in a mixed LoRA batch must get no adapter (vLLM 0.32.x, CPU).

vLLM's PyTorch LoRA ops (`vllm/lora/ops/torch_ops/lora_ops.py`, used only by the CPU punica wrapper)
pick each row's adapter by gathering the stacked adapter weights with the row's slot index, where -1
means "no adapter". Torch reads -1 as "the last slot", so when the last slot holds an adapter, the
base-model requests of a batch that also carries adapter requests are served with that adapter
(upstream: https://github.com/vllm-project/vllm/pull/48421 and
https://github.com/vllm-project/vllm/pull/49656). The three `bgmv_*` functions are where it happens; the
`sgmv_*` prefill variants and the punica wrapper's decode/logits paths all end in them.

The replacements group the rows by slot and run one matmul per adapter present in the batch; rows whose
index is -1 get zeros, so a row with an adapter computes what vLLM computes and a row without one adds
nothing. Grouping also removes vLLM's per-row copy of the weights, which makes LoRA prefill on CPU far
slower than the base model's (see `_per_row_lora`).

vLLM calls `register()` in every process it starts (API server, engine core) through the documented
`vllm.general_plugins` entry point `artlike_lora_fix` declared in pyproject.toml. It patches only when
the installed vLLM is 0.32.x and a tiny probe shows the bug is present, and logs what it did. Setting
`ARTLIKE_DISABLE_VLLM_PLUGIN=1` in the engine's environment turns it off (the mixed-batch test uses it
to show the bug).
"""

from __future__ import annotations

import logging
import os
import sys
from types import ModuleType

import torch

from artlike_server.engine.plugin_log import visible_logger

# A child of vLLM's "vllm" logger, so the lines land in the engine log in vLLM's own format.
logger = logging.getLogger("vllm.plugins.artlike_lora_fix")

DISABLE_ENV = "ARTLIKE_DISABLE_VLLM_PLUGIN"
_SUPPORTED_VERSION_PREFIX = "0.32."
_LORA_OPS = "vllm.lora.ops.torch_ops.lora_ops"
_TORCH_OPS = "vllm.lora.ops.torch_ops"
_PUNICA_CPU = "vllm.lora.punica_wrapper.punica_cpu"


def _per_row_lora(
    inputs: torch.Tensor, stacked_weights: torch.Tensor, slot_indices: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """`inputs[b] @ stacked_weights[slot_indices[b]].T` per row; rows whose slot index is -1 are zero.

    One matmul per adapter present in the batch, on that adapter's rows. vLLM's op instead gathers a copy
    of the weights for every row, a (rows, out, in) tensor: for a 1,461-token prefill with a rank-8
    adapter that is gigabytes of copies per forward pass, which then dominate the prefill's time.
    """
    weights = stacked_weights.squeeze(dim=1) if stacked_weights.dim() == 4 else stacked_weights  # (slots, out, in)
    rows = inputs.to(dtype=dtype)
    slots = torch.unique(slot_indices).tolist()
    if len(slots) == 1 and slots[0] >= 0:  # the common case: every row uses the same adapter
        return rows @ weights[slots[0]].to(dtype=dtype).T
    outputs = rows.new_zeros(rows.shape[0], weights.shape[1])
    for slot in slots:
        if slot < 0:
            continue  # no adapter: these rows stay zero
        members = (slot_indices == slot).nonzero().squeeze(dim=1)
        outputs.index_copy_(0, members, rows.index_select(0, members) @ weights[slot].to(dtype=dtype).T)
    return outputs


# The three functions below keep vLLM 0.32's signatures and output semantics; only the gather differs.


def bgmv_shrink(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,  # vLLM's name; these are the A ("shrink") weights
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    scaling: float = 1.0,
) -> None:
    outputs = _per_row_lora(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs[:]


def bgmv_expand(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    add_inputs: bool = True,
) -> None:
    outputs = _per_row_lora(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    limit = output_tensor.shape[0]
    if outputs.shape[0] == 1 and output_tensor.shape[0] != 1:
        limit = 1
    # LoRA adapter and model may add different amounts of padding to output
    common_len = min(outputs.shape[1], output_tensor.shape[1])
    if add_inputs:
        output_tensor[:, :common_len] += outputs[:limit, :common_len]
    else:
        output_tensor[:, :common_len] = outputs[:limit, :common_len]


def bgmv_expand_slice(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    slice_offset: int,
    slice_size: int,
    add_inputs: bool = True,
) -> None:
    outputs = _per_row_lora(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset : slice_offset + slice_size] += outputs[:]
    else:
        output_tensor[:, slice_offset : slice_offset + slice_size] = outputs[:]


_REPLACEMENTS = {
    "bgmv_shrink": bgmv_shrink,
    "bgmv_expand": bgmv_expand,
    "bgmv_expand_slice": bgmv_expand_slice,
}


def no_adapter_row_leaks(lora_ops: ModuleType) -> bool:
    """Probe: does `lora_ops.bgmv_shrink` apply the last slot to a row whose slot index is -1?

    Slot 0 holds zeros and slot 1 (the last) ones; a correct kernel leaves the row at 0.
    """
    weights = torch.zeros(2, 1, 1, 1)
    weights[1] = 1.0
    output = torch.zeros(1, 1)
    lora_ops.bgmv_shrink(torch.ones(1, 1), weights, output, torch.tensor([-1]), 1.0)
    return bool(output.item() != 0.0)


def register() -> None:
    """Entry point called by vLLM in each of its processes; idempotent and cheap."""
    visible_logger(logger.name)
    if os.environ.get(DISABLE_ENV) == "1":
        logger.warning(
            "artlike LoRA fix disabled by %s=1: mixed base/adapter batches may be wrong", DISABLE_ENV
        )
        return

    import vllm

    version = vllm.__version__
    if not version.startswith(_SUPPORTED_VERSION_PREFIX):
        logger.warning(
            "artlike LoRA fix targets vLLM %sx; vLLM %s is installed, so nothing was patched",
            _SUPPORTED_VERSION_PREFIX,
            version,
        )
        return

    import importlib

    lora_ops = importlib.import_module(_LORA_OPS)
    missing = [name for name in _REPLACEMENTS if not callable(getattr(lora_ops, name, None))]
    if missing:
        logger.warning("artlike LoRA fix: %s has no %s; nothing was patched", _LORA_OPS, ", ".join(missing))
        return
    if lora_ops.bgmv_shrink is bgmv_shrink:
        return  # already applied in this process
    if not no_adapter_row_leaks(lora_ops):
        logger.info(
            "artlike LoRA fix: vLLM %s handles rows without an adapter already; nothing patched", version
        )
        return

    # `lora_ops` itself: its sgmv_* functions look the bgmv_* names up there at call time. The
    # `torch_ops` package and the CPU punica wrapper bound the names at import, so they are patched
    # too (the wrapper only if already imported; if imported later it binds the patched package names).
    namespaces = [lora_ops, importlib.import_module(_TORCH_OPS)]
    if _PUNICA_CPU in sys.modules:
        namespaces.append(sys.modules[_PUNICA_CPU])
    for namespace in namespaces:
        for name, replacement in _REPLACEMENTS.items():
            if hasattr(namespace, name):
                setattr(namespace, name, replacement)
    logger.info(
        "artlike LoRA fix applied (vLLM %s, pid %d): %s in %s",
        version,
        os.getpid(),
        ", ".join(_REPLACEMENTS),
        ", ".join(namespace.__name__ for namespace in namespaces),
    )
