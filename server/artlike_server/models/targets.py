"""Which modules of the base model a LoRA may target: the linear layers of its decoder blocks.

Read from the weights' safetensors headers (names and shapes only, no torch, no tensor data), so a bad
`lora.target_modules` is a 400 before the trainer builds anything. vLLM serves LoRA on the decoder blocks'
linear projections (attention q/k/v/o, MLP gate/up/down and their kin); embeddings, the LM head and norms
are refused by it (or by PEFT), so they are refused here, by name, with the servable choices listed.

Matching follows PEFT: a target names a module when it equals the module's full name or its last dotted
parts (`q_proj` matches `model.layers.0.self_attn.q_proj`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidRequest
from ..safetensors_header import safetensors_shapes


@dataclass(frozen=True)
class ModuleNames:
    """The base model's module names (weights without their `.weight`/`.bias` suffix), split by kind."""

    linear_in_blocks: frozenset[str]  # 2-D weights inside the decoder blocks: what LoRA may target
    other: frozenset[str]  # everything else: embeddings, LM head, norms, biases' owners outside the blocks

    @property
    def servable_short_names(self) -> list[str]:
        return sorted({name.rsplit(".", 1)[-1] for name in self.linear_in_blocks})


def read_module_names(model_dir: Path) -> ModuleNames | None:
    """Module names from the model directory's `*.safetensors` headers; None when there are none to read
    (a hub id, or weights in another format): the caller then leaves the check to the trainer."""
    files = sorted(Path(model_dir).glob("*.safetensors")) if Path(model_dir).is_dir() else []
    if not files:
        return None
    shapes: dict[str, list[int]] = {}
    for path in files:
        shapes.update(safetensors_shapes(path))
    linear, other = set(), set()
    for key, shape in shapes.items():
        module, _, kind = key.rpartition(".")
        if kind == "weight" and len(shape) == 2 and ".layers." in f".{module}.":
            linear.add(module)
        else:
            other.add(module)
    return ModuleNames(frozenset(linear), frozenset(other - linear))


def _matches(target: str, module: str) -> bool:
    return module == target or module.endswith("." + target)


def check_target_modules(targets: Sequence[str], modules: ModuleNames) -> None:
    """Raise InvalidRequest (param `lora.target_modules`) naming the first target LoRA cannot be put on."""
    choices = ", ".join(modules.servable_short_names)
    for target in targets:
        hits_linear = _any_match(target, modules.linear_in_blocks)
        hits_other = _any_match(target, modules.other)
        if hits_other:
            raise InvalidRequest(
                f"lora.target_modules: {target!r} names a module LoRA cannot be served on (embeddings, the LM "
                f"head and norms are not decoder-block linear layers); choose from: {choices}",
                param="lora.target_modules", code="invalid_target_modules")
        if not hits_linear:
            raise InvalidRequest(
                f"lora.target_modules: {target!r} matches no module of the base model; choose from: {choices}",
                param="lora.target_modules", code="invalid_target_modules")


def _any_match(target: str, modules: Iterable[str]) -> bool:
    return any(_matches(target, module) for module in modules)
