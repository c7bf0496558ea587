"""Fold a PEFT LoRA adapter into base weights: `W' = W + scaling · B @ A`, one base tensor at a time.

Used inside the policy engine (a vLLM process, see `merge_transfer.py`), never by the server process: it
imports torch. Which adapters qualify is `merge_check`'s decision, made from headers before any tensor is
read.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from .merge_check import (
    ADAPTER_WEIGHTS,
    UnsupportedAdapter,
    base_weight_files,
    check_mergeable,
    lora_module,
    read_adapter_config,
)


@dataclass(frozen=True)
class LoraDelta:
    """One linear layer's low-rank update: `scaling · B @ A` has the base weight's shape (out, in)."""

    a: torch.Tensor  # (r, in)
    b: torch.Tensor  # (out, r)
    scaling: float


def lora_scaling(alpha: float, rank: int, *, rslora: bool) -> float:
    """PEFT's scaling: alpha / r, or alpha / sqrt(r) for rsLoRA. E.g. alpha 16, r 8 → 2.0 (rsLoRA: 5.657)."""
    if rank <= 0:
        raise UnsupportedAdapter(f"LoRA rank must be positive, got {rank}")
    return alpha / math.sqrt(rank) if rslora else alpha / rank


def merged_weight(base: torch.Tensor, delta: LoraDelta) -> torch.Tensor:
    """`base + scaling · B @ A`, computed in float32 and returned in the base weight's dtype."""
    update = delta.scaling * (delta.b.to(torch.float32) @ delta.a.to(torch.float32))
    if update.shape != base.shape:
        raise UnsupportedAdapter(f"LoRA update has shape {tuple(update.shape)}, the base weight {tuple(base.shape)}")
    return (base.to(torch.float32) + update).to(base.dtype)


def pattern_value(patterns: dict[str, float], module: str, default: float) -> float:
    """PEFT's rank_pattern / alpha_pattern: the first key naming the module (a dotted suffix or a regex)."""
    for key, value in patterns.items():
        if module == key or module.endswith(f".{key}") or re.fullmatch(key, module):
            return value
    return default


def read_adapter(adapter_dir: Path, model_dir: Path) -> dict[str, LoraDelta]:
    """The adapter's updates keyed by the base checkpoint's weight name (`model.layers.0.mlp.up_proj.weight`),
    after `check_mergeable` accepted it against `model_dir`'s checkpoint."""
    check_mergeable(adapter_dir, model_dir)
    config = read_adapter_config(adapter_dir)
    rank, alpha, rslora = int(config["r"]), float(config["lora_alpha"]), bool(config.get("use_rslora"))
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(adapter_dir / ADAPTER_WEIGHTS), framework="pt") as tensors:
        for key in tensors.keys():  # noqa: SIM118 (safe_open is not a mapping)
            module, which = lora_module(key)
            pairs.setdefault(module, {})[which] = tensors.get_tensor(key)
    return {
        f"{module}.weight": LoraDelta(
            pair["A"], pair["B"],
            lora_scaling(pattern_value(alpha_pattern, module, alpha),
                         int(pattern_value(rank_pattern, module, rank)), rslora=rslora),
        )
        for module, pair in pairs.items()
    }


def merged_weights(model_dir: Path, deltas: dict[str, LoraDelta]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every base tensor in checkpoint order, with the adapter folded into the ones it changes. An empty
    `deltas` gives the base weights back."""
    for path in base_weight_files(model_dir):
        with safe_open(str(path), framework="pt") as tensors:
            for name in tensors.keys():  # noqa: SIM118
                tensor = tensors.get_tensor(name)
                delta = deltas.get(name)
                yield name, (tensor if delta is None else merged_weight(tensor, delta))
