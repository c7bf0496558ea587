"""The LoRA adapters resident in the trainer: one PEFT model around the base, one adapter per model name.

An adapter directory is the PEFT format (`adapter_config.json` + `adapter_model.safetensors`, keys without
the adapter name), which both `PeftModel.from_pretrained` and vLLM's `/v1/load_lora_adapter` read.
PEFT's own `save_pretrained` writes a non-"default" adapter into a sub-directory named after it, so the
files are written here directly, into a temporary directory that is renamed into place.

Model names may contain '.', which PEFT adapter names (torch ModuleDict keys) may not: each model name gets
an internal key ("m0", "m1", ...).
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import peft
import torch
from peft import PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from artlike.types import LoraConfig
from artlike_server.trainer.precision import MasterWeights

REFERENCE_KEY = "reference"  # the PEFT adapter name of a reference step while it is in use
WEIGHTS_FILE = "adapter_model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"  # AdamW's state dict (tensors and numbers only: torch.load(weights_only=True))
CONFIG_FILE = "adapter_config.json"


class AdapterError(ValueError):
    """An adapter directory is missing, incomplete, or does not fit the base model."""


def peft_lora_config(lora: LoraConfig, base_model_path: str) -> peft.LoraConfig:
    return peft.LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,  # type: ignore[arg-type]  # peft annotates int; a float scale works
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model_path,
    )


def _shape_of(config: peft.LoraConfig) -> tuple[object, ...]:
    """What must match for two configs to describe the same adapter parameters."""
    targets = config.target_modules
    targets_key = tuple(sorted(targets)) if isinstance(targets, list | set | tuple) else targets
    return (config.r, config.lora_alpha, config.lora_dropout, targets_key, config.use_rslora, config.bias)


@dataclass
class AdapterSlot:
    key: str  # PEFT adapter name inside the shared PeftModel
    config: peft.LoraConfig
    optimizer: torch.optim.Optimizer | None = None  # kept between jobs, see AdapterSlots.load
    master: MasterWeights | None = None  # fp32 copies of bf16 adapter weights, owned by the optimizer

    def start_optimizer(
        self, parameters: list[torch.nn.Parameter], *, learning_rate: float, weight_decay: float
    ) -> torch.optim.Optimizer:
        """AdamW over fp32 master copies of `parameters` when they are low precision, else over them."""
        self.master = MasterWeights(parameters) if MasterWeights.needed(parameters) else None
        self.optimizer = torch.optim.AdamW(
            self.master.parameters if self.master is not None else parameters,
            lr=learning_rate,
            weight_decay=weight_decay,
        )
        return self.optimizer

    def drop_optimizer(self) -> None:
        self.optimizer = None
        self.master = None


class AdapterSlots:
    def __init__(self, base_model: PreTrainedModel, base_model_path: str) -> None:
        self._base = base_model
        self._base_path = base_model_path
        self._model: PeftModel | None = None
        self._slots: dict[str, AdapterSlot] = {}
        self._next_key = 0

    @property
    def model(self) -> PeftModel:
        if self._model is None:
            raise AdapterError("no adapter has been created or loaded yet")
        return self._model

    def slot(self, model_name: str) -> AdapterSlot:
        return self._slots[model_name]

    def create(self, model_name: str, config: peft.LoraConfig, *, seed: int) -> AdapterSlot:
        """A fresh adapter (lora_B = 0: outputs equal the base model's), replacing any previous one of that name."""
        key = f"m{self._next_key}"
        self._next_key += 1
        # PEFT draws lora_A from the global generator; seeding it makes a registration reproducible.
        torch.manual_seed(seed)
        # Adapters in the base model's dtype (no fp32 upcast): see training.precision.
        if self._model is None:
            self._model = get_peft_model(self._base, config, adapter_name=key, autocast_adapter_dtype=False)
        else:
            self._model.add_adapter(key, config, autocast_adapter_dtype=False)
        previous = self._slots.get(model_name)
        if previous is not None:
            self._model.delete_adapter(previous.key)
        slot = AdapterSlot(key=key, config=config)
        self._slots[model_name] = slot
        self.activate(model_name)
        return slot

    def activate(self, model_name: str) -> None:
        # set_adapter also makes exactly this adapter's parameters require grad.
        self.model.set_adapter(self._slots[model_name].key)

    def load(self, model_name: str, adapter_dir: Path) -> AdapterSlot:
        """Make `adapter_dir`'s weights the active adapter of `model_name`.

        The slot's optimizer state survives only when the directory holds exactly the weights already in
        memory, i.e. the step this trainer produced last: Adam's moments then continue the run they were
        accumulated on. For any other weights (a rollback to an older step, a restarted worker, an adapter
        trained elsewhere) the moments would describe a different trajectory and are dropped.
        """
        config = _read_config(adapter_dir)
        weights = _read_weights(adapter_dir)
        slot = self._slots.get(model_name)
        if slot is None or _shape_of(slot.config) != _shape_of(config):
            slot = self.create(model_name, config, seed=0)
        self.activate(model_name)
        current = get_peft_model_state_dict(self.model, adapter_name=slot.key)
        if current.keys() != weights.keys():
            missing = sorted(set(current) ^ set(weights))[:3]
            raise AdapterError(f"{adapter_dir} does not match its adapter_config.json (e.g. {missing})")
        if not all(torch.equal(weights[k].to(current[k].dtype), current[k]) for k in current):
            result: Any = set_peft_model_state_dict(self.model, weights, adapter_name=slot.key)
            if result.unexpected_keys:
                raise AdapterError(f"{adapter_dir} has unexpected keys, e.g. {result.unexpected_keys[:3]}")
            slot.drop_optimizer()
        return slot

    def save(self, model_name: str, out_dir: Path, *, with_optimizer: bool = False) -> Path:
        """Write the adapter as a PEFT directory at `out_dir` (absent or an empty directory), atomically;
        `with_optimizer`: its AdamW state beside it (`OPTIMIZER_FILE`), to resume training from it exactly."""
        slot = self._slots[model_name]
        out_dir = Path(out_dir)
        check_writable(out_dir)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
        try:
            state = get_peft_model_state_dict(self.model, adapter_name=slot.key)
            save_file({k: v.detach().contiguous() for k, v in state.items()}, str(tmp / WEIGHTS_FILE))
            if with_optimizer and slot.optimizer is not None:
                torch.save(slot.optimizer.state_dict(), tmp / OPTIMIZER_FILE)
            config = copy.deepcopy(slot.config)
            config.inference_mode = True
            config.base_model_name_or_path = self._base_path
            config.save_pretrained(str(tmp))
            os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the adapter is read by vLLM and by people
            if out_dir.is_dir():
                out_dir.rmdir()  # the caller's empty staging directory; rmdir refuses a non-empty one
            tmp.rename(out_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return out_dir

    def reference_policy(self, model_name: str, adapter_dir: Path | None) -> Callable[[], AbstractContextManager[Any]]:
        """What makes the model the reference policy of `model_name`'s training: the base model (its adapter
        disabled), or the step at `adapter_dir` (`reference`)."""
        if adapter_dir is None:
            return self.model.disable_adapter
        return partial(self.reference, adapter_dir, model_name)

    @contextmanager
    def reference(self, adapter_dir: Path, active_model: str) -> Iterator[None]:
        """Within the block the model is `adapter_dir`'s adapter (a step used as a reference policy, e.g. DPO's
        `reference: "name@N"`); afterwards `active_model`'s adapter is active again and the reference is gone."""
        config = _read_config(adapter_dir)
        weights = _read_weights(adapter_dir)
        self.model.add_adapter(REFERENCE_KEY, config, autocast_adapter_dtype=False)
        try:
            result: Any = set_peft_model_state_dict(self.model, weights, adapter_name=REFERENCE_KEY)
            if result.unexpected_keys:
                raise AdapterError(f"{adapter_dir} has unexpected keys, e.g. {result.unexpected_keys[:3]}")
            self.model.set_adapter(REFERENCE_KEY)
            yield
        finally:
            self.activate(active_model)
            self.model.delete_adapter(REFERENCE_KEY)

    def parameters(self, model_name: str) -> list[torch.nn.Parameter]:
        key = self._slots[model_name].key
        return [p for name, p in self.model.named_parameters() if f".{key}." in name]


def check_writable(out_dir: Path) -> None:
    """Adapters are never overwritten: `out_dir` must not exist or be an empty directory."""
    if out_dir.exists() and not (out_dir.is_dir() and not any(out_dir.iterdir())):
        raise AdapterError(
            f"{out_dir} already exists and is not an empty directory; adapters are never overwritten"
        )


def _read_config(adapter_dir: Path) -> peft.LoraConfig:
    if not (Path(adapter_dir) / CONFIG_FILE).is_file():
        raise AdapterError(f"{adapter_dir} has no {CONFIG_FILE}")
    config: peft.LoraConfig = peft.LoraConfig.from_pretrained(str(adapter_dir))
    config.inference_mode = False
    return config


def _read_weights(adapter_dir: Path) -> dict[str, torch.Tensor]:
    path = Path(adapter_dir) / WEIGHTS_FILE
    if not path.is_file():
        raise AdapterError(f"{adapter_dir} has no {WEIGHTS_FILE}")
    return load_file(str(path))
