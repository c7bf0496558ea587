"""Can a LoRA adapter be folded into the base weights? Decided from JSON and safetensors headers only.

The server process (no torch) calls `check_mergeable` before it asks the policy engine to merge a step:
vLLM turns a failed weight update into a dead engine, so every refusal must happen here. The engine's
merge (`adapter_merge.py`) runs the same check again before it touches a weight.

Mergeable: plain LoRA on linear layers, as artlike's trainer writes it (`lora_A`/`lora_B` pairs, rsLoRA
and per-module rank/alpha patterns included). DoRA, `modules_to_save`, trainable tokens, LoRA biases,
trained biases and fan-in-fan-out layouts are not: such steps keep being served as LoRA adapters.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ..safetensors_header import safetensors_shapes

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])(?:\.default)?\.weight$")
_REFUSED_FLAGS = (("use_dora", "DoRA"), ("fan_in_fan_out", "fan-in-fan-out layers"),
                  ("modules_to_save", "fully trained modules (modules_to_save)"),
                  ("trainable_token_indices", "trainable tokens"), ("lora_bias", "LoRA biases"))


class UnsupportedAdapter(ValueError):
    """The adapter cannot be folded into the base weights (it stays a LoRA adapter)."""


def read_adapter_config(adapter_dir: Path) -> dict[str, Any]:
    """The adapter's PEFT config, refused unless it describes a mergeable plain LoRA."""
    config_path, weights_path = adapter_dir / ADAPTER_CONFIG, adapter_dir / ADAPTER_WEIGHTS
    if not config_path.is_file() or not weights_path.is_file():
        raise UnsupportedAdapter(f"{adapter_dir} is not a PEFT adapter directory ({ADAPTER_CONFIG} + {ADAPTER_WEIGHTS})")
    config: dict[str, Any] = json.loads(config_path.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise UnsupportedAdapter(f"only LoRA adapters merge, this one is {config.get('peft_type')}")
    for flag, why in _REFUSED_FLAGS:
        if config.get(flag):
            raise UnsupportedAdapter(f"adapters with {why} are served as LoRA, not merged")
    if config.get("bias", "none") != "none":
        raise UnsupportedAdapter("adapters that train biases are served as LoRA, not merged")
    return config


def lora_module(tensor_name: str) -> tuple[str, str]:
    """'base_model.model.model.layers.0.mlp.up_proj.lora_A.weight' → ('model.layers.0.mlp.up_proj', 'A')."""
    match = LORA_KEY.match(tensor_name.removeprefix(PEFT_PREFIX))
    if match is None:
        raise UnsupportedAdapter(f"adapter tensor {tensor_name!r} is not a LoRA A/B matrix")
    return match["module"], match["which"]


def base_weight_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors")) if model_dir.is_dir() else []
    if not files:
        raise UnsupportedAdapter(f"{model_dir} has no *.safetensors weights to merge into")
    return files


def check_mergeable(adapter_dir: Path, model_dir: Path) -> None:
    """Raise `UnsupportedAdapter` unless every LoRA pair fits a base weight: `B @ A` of its shape."""
    read_adapter_config(adapter_dir)
    pairs: dict[str, dict[str, list[int]]] = {}
    for name, shape in safetensors_shapes(adapter_dir / ADAPTER_WEIGHTS).items():
        module, which = lora_module(name)
        pairs.setdefault(module, {})[which] = shape
    if not pairs:
        raise UnsupportedAdapter(f"{adapter_dir} holds no LoRA matrices")
    base: dict[str, list[int]] = {}
    for path in base_weight_files(model_dir):
        base.update(safetensors_shapes(path))
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise UnsupportedAdapter(f"module {module!r} lacks its lora_{'B' if 'A' in pair else 'A'} matrix")
        weight = f"{module}.weight"
        if weight not in base:
            raise UnsupportedAdapter(f"the base checkpoint has no weight {weight!r} for this adapter")
        a, b = pair["A"], pair["B"]
        if len(a) != 2 or len(b) != 2 or a[0] != b[1] or base[weight] != [b[0], a[1]]:
            raise UnsupportedAdapter(f"LoRA matrices {b} @ {a} do not fit {weight!r} of shape {base[weight]}")
