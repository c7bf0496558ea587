"""Is a PEFT LoRA adapter trained elsewhere servable and trainable here? Decided from `adapter_config.json`
and the safetensors headers of the adapter and the base alone (no torch, no tensor data).

Each refusal is an `InvalidRequest` (400) whose `param` names what is wrong: `adapter` (the files),
`adapter_config.<field>` (a field of the config), or `adapter_model.safetensors` (the weights). The checks:

- the files: `adapter_config.json` and `adapter_model.safetensors` (a pickled `adapter_model.bin` is refused:
  loading a pickle can run code), readable, the weights not truncated;
- the kind: a plain LoRA for causal LM (no DoRA, LoRA biases, trained biases, fully trained modules, trainable
  tokens, fan-in-fan-out layouts, or inits that change the base weights: vLLM serves none of them);
- the base: `base_model_name_or_path` names this server's base (by its last path part, so a local copy or a
  hub mirror of the same model counts; `any_base_name` skips this), and every LoRA pair fits a decoder-block
  linear layer of the base with the base's shapes;
- the rank: at most the engine's `--max-lora-rank`;
- the dtype: float32, float16 or bfloat16 tensors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from artlike.types import LoraConfig

from ..engine.merge_check import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LORA_KEY, PEFT_PREFIX
from ..errors import InvalidRequest
from ..models.targets import read_module_names
from ..safetensors_header import SafetensorsHeaderError, TensorEntry, safetensors_shapes, safetensors_tensors

CONFIG_FILE, WEIGHTS_FILE = ADAPTER_CONFIG, ADAPTER_WEIGHTS  # the names PEFT writes, as the merge check reads them
PICKLED_WEIGHTS_FILE = "adapter_model.bin"
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
MAX_RANK = 256  # LoraConfig's own limit

# Config fields that make an adapter something other than a plain LoRA, with what they are.
_REFUSED_FIELDS = (
    ("use_dora", "DoRA"), ("lora_bias", "LoRA biases"), ("modules_to_save", "fully trained modules"),
    ("trainable_token_indices", "trainable tokens"), ("fan_in_fan_out", "fan-in-fan-out (Conv1D) layers"),
    ("layer_replication", "layer replication"), ("use_qalora", "QA-LoRA"), ("use_bdlora", "block-diagonal LoRA"),
    ("alora_invocation_tokens", "activated LoRA"), ("target_parameters", "LoRA on parameters"),
)
# String inits that only set the first weights (a saved adapter is a plain LoRA); the others (PiSSA, OLoRA,
# LoftQ, CorDA) change the base weights as PEFT loads the adapter.
_PLAIN_INITS = {"gaussian", "eva", "orthogonal", "mica", "lora_ga"}
# Suffixes of quantised or renamed copies of a base that carry the same weights once dequantised.
_MIRROR_SUFFIXES = ("-unsloth-bnb-4bit", "-bnb-4bit", "-bnb-8bit", "-unsloth")


@dataclass(frozen=True)
class BaseModel:
    """The base an adapter must fit: its id, its directory (or hub id) and the engine's rank limit."""

    name: str
    path: Path
    max_lora_rank: int


@dataclass(frozen=True)
class CheckedAdapter:
    directory: Path
    config: dict[str, Any]  # adapter_config.json as read
    lora: LoraConfig  # the adapter's LoRA as a model records it (targets: the short names it has weights for)
    dtypes: tuple[str, ...]  # its tensors' dtypes (torch names)
    modules: int  # how many linear layers it adapts

    @property
    def source_base(self) -> str | None:
        value = self.config.get("base_model_name_or_path")
        return value if isinstance(value, str) and value else None


def check_files(directory: Path) -> None:
    """The adapter's two files are there (a pickle-only adapter gets its own message)."""
    if not directory.is_dir():
        raise _invalid(f"{directory} is not a directory", "adapter", "invalid_adapter")
    if not (directory / CONFIG_FILE).is_file():
        raise _invalid(f"no {CONFIG_FILE} in the adapter: not a PEFT adapter directory", "adapter",
                       "invalid_adapter")
    if not (directory / WEIGHTS_FILE).is_file():
        if (directory / PICKLED_WEIGHTS_FILE).is_file():
            raise _invalid(
                f"the adapter's weights are {PICKLED_WEIGHTS_FILE}, a pickle (loading one can run code); only "
                f"{WEIGHTS_FILE} is read. Convert it where you trust it: PeftModel.from_pretrained(base, DIR)"
                ".save_pretrained(OUT) writes safetensors", "adapter", "unsupported_adapter_format")
        raise _invalid(f"no {WEIGHTS_FILE} in the adapter", "adapter", "invalid_adapter")


def check_adapter(directory: Path, base: BaseModel, *, any_base_name: bool = False) -> CheckedAdapter:
    """The adapter at `directory`, checked against `base`; `InvalidRequest` naming the first problem."""
    check_files(directory)
    config = read_config(directory / CONFIG_FILE)
    rank = check_config(config, base.max_lora_rank)
    if not any_base_name:
        check_base_name(config.get("base_model_name_or_path"), base)
    tensors = read_weights(directory / WEIGHTS_FILE)
    pairs = lora_pairs(tensors)
    check_against_base(pairs, base)
    for module, (a, _) in pairs.items():
        if a[0] > base.max_lora_rank:
            raise _invalid(f"module {module!r} has LoRA rank {a[0]}, above the engine's --max-lora-rank "
                           f"{base.max_lora_rank}", "adapter_config.r", "invalid_value")
        if not config.get("rank_pattern") and a[0] != rank:
            raise _invalid(f"module {module!r} has LoRA rank {a[0]} but adapter_config.json says r={rank}",
                           WEIGHTS_FILE, "invalid_adapter")
    dtypes = sorted({DTYPES[entry.dtype] for entry in tensors.values()})
    targets = sorted({module.rsplit(".", 1)[-1] for module in pairs})
    lora = LoraConfig(rank=rank, alpha=float(config.get("lora_alpha") or rank),
                      dropout=min(max(float(config.get("lora_dropout") or 0.0), 0.0), 0.99), target_modules=targets)
    return CheckedAdapter(directory, config, lora, tuple(dtypes), len(pairs))


def read_config(path: Path) -> dict[str, Any]:
    try:
        config = orjson.loads(path.read_bytes())
    except orjson.JSONDecodeError as error:
        raise _invalid(f"{CONFIG_FILE} is not JSON ({error})", "adapter", "invalid_adapter") from None
    if not isinstance(config, dict):
        raise _invalid(f"{CONFIG_FILE} is not a JSON object", "adapter", "invalid_adapter")
    return config


def check_config(config: Mapping[str, Any], max_lora_rank: int) -> int:
    """The fields that make it a servable plain LoRA for causal LM; returns its rank `r`."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise _invalid(f"the adapter is {peft_type}, not LoRA: only LoRA adapters are served",
                       "adapter_config.peft_type", "unsupported_adapter")
    task = config.get("task_type")
    if task not in (None, "CAUSAL_LM"):
        raise _invalid(f"the adapter's task_type is {task!r}: only CAUSAL_LM adapters (policies) are imported",
                       "adapter_config.task_type", "unsupported_adapter")
    for field, what in _REFUSED_FIELDS:
        if config.get(field):
            raise _invalid(f"the adapter uses {what} ({field}), which the engine cannot serve",
                           f"adapter_config.{field}", "unsupported_adapter")
    if config.get("bias", "none") != "none":
        raise _invalid(f"the adapter trains biases (bias={config.get('bias')!r}), which the engine cannot serve",
                       "adapter_config.bias", "unsupported_adapter")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in _PLAIN_INITS:
        raise _invalid(f"init_lora_weights={init!r} changes the base weights when the adapter loads; convert "
                       "it to a plain LoRA first (PEFT's path_initial_model_for_weight_conversion)",
                       "adapter_config.init_lora_weights", "unsupported_adapter")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise _invalid(f"r must be a positive integer, not {rank!r}", "adapter_config.r", "invalid_value")
    pattern = config.get("rank_pattern") or {}
    ranks = [rank, *(v for v in pattern.values() if isinstance(v, int))] if isinstance(pattern, dict) else [rank]
    limit = min(max_lora_rank, MAX_RANK)
    if max(ranks) > limit:
        raise _invalid(f"the adapter's rank {max(ranks)} exceeds the engine's --max-lora-rank {limit}",
                       "adapter_config.r", "invalid_value")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha) or alpha <= 0:
        raise _invalid(f"lora_alpha must be a positive number, not {alpha!r}", "adapter_config.lora_alpha",
                       "invalid_value")
    return rank


def check_base_name(named: Any, base: BaseModel) -> None:
    """The base the adapter names is this server's base: the same id or path, or the same last part (a local
    copy, a hub mirror, a bitsandbytes-quantised copy). An adapter that names none passes (shapes decide)."""
    if not isinstance(named, str) or not named:
        return
    if _base_key(named) in {_base_key(base.name), _base_key(str(base.path))}:
        return
    raise _invalid(f"the adapter was trained on {named!r}; this server serves {base.name!r}. If it is the same "
                   "model under another name, import with any_base_name (--any-base-name)",
                   "adapter_config.base_model_name_or_path", "base_model_mismatch")


def _base_key(name: str) -> str:
    last = name.rstrip("/").rsplit("/", 1)[-1].lower()
    for suffix in _MIRROR_SUFFIXES:
        last = last.removesuffix(suffix)
    return last


def read_weights(path: Path) -> dict[str, TensorEntry]:
    try:
        tensors = safetensors_tensors(path)
    except (OSError, SafetensorsHeaderError) as error:
        raise _invalid(f"{WEIGHTS_FILE} is not a readable safetensors file: {error}".replace(str(path), path.name),
                       WEIGHTS_FILE, "invalid_adapter") from None
    if not tensors:
        raise _invalid(f"{WEIGHTS_FILE} holds no tensors", WEIGHTS_FILE, "invalid_adapter")
    for key, entry in tensors.items():
        if entry.dtype not in DTYPES:
            raise _invalid(f"tensor {key!r} is {entry.dtype}; adapters are imported in float32, float16 or "
                           "bfloat16", WEIGHTS_FILE, "unsupported_dtype")
    return tensors


def lora_pairs(tensors: Mapping[str, TensorEntry]) -> dict[str, tuple[list[int], list[int]]]:
    """Module name (as in the base's weights) → (lora_A shape, lora_B shape); every tensor must be one."""
    halves: dict[str, dict[str, list[int]]] = {}
    for key, entry in tensors.items():
        match = LORA_KEY.match(key.removeprefix(PEFT_PREFIX))
        if match is None:
            raise _invalid(f"tensor {key!r} is not a LoRA A or B matrix (embeddings, biases and fully trained "
                           "modules are not served)", WEIGHTS_FILE, "unsupported_adapter")
        halves.setdefault(match["module"], {})[match["which"]] = entry.shape
    pairs = {}
    for module, half in sorted(halves.items()):
        if set(half) != {"A", "B"}:
            missing = "B" if "A" in half else "A"
            raise _invalid(f"module {module!r} has no lora_{missing} matrix", WEIGHTS_FILE, "invalid_adapter")
        a, b = half["A"], half["B"]
        if len(a) != 2 or len(b) != 2 or a[0] != b[1] or a[0] < 1:
            raise _invalid(f"module {module!r}: lora_B {b} @ lora_A {a} is not a low-rank pair", WEIGHTS_FILE,
                           "invalid_adapter")
        pairs[module] = (a, b)
    return pairs


def check_against_base(pairs: Mapping[str, tuple[list[int], list[int]]], base: BaseModel) -> None:
    """Every pair adapts a decoder-block linear layer of the base, with its shape. Skipped when the base's
    weights are not on this machine as safetensors (a hub id): the engine's load then decides."""
    modules = read_module_names(base.path)
    if modules is None:
        return
    shapes: dict[str, list[int]] = {}
    for path in sorted(Path(base.path).glob("*.safetensors")):
        shapes.update(safetensors_shapes(path))
    choices = ", ".join(modules.servable_short_names)
    for module, (a, b) in pairs.items():
        weight = shapes.get(f"{module}.weight")
        if weight is None:
            raise _invalid(f"the adapter adapts {module!r}, which {base.name!r} does not have: it was trained on "
                           "another base model", WEIGHTS_FILE, "base_model_mismatch")
        if module not in modules.linear_in_blocks:
            raise _invalid(f"the adapter adapts {module!r}, which LoRA cannot be served on (embeddings, the LM "
                           f"head and norms are not decoder-block linear layers); servable: {choices}",
                           "adapter_config.target_modules", "invalid_target_modules")
        if weight != [b[0], a[1]]:
            raise _invalid(f"the adapter's {module!r} is {b[0]}x{a[1]} but {base.name!r} has {weight[0]}x"
                           f"{weight[1]}: it was trained on another base model", WEIGHTS_FILE,
                           "base_model_mismatch")


def _invalid(message: str, param: str, code: str) -> InvalidRequest:
    return InvalidRequest(message, param=param, code=code)

