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
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import orjson
import peft
import torch
from peft import PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedModel

from artlike.types import LoraConfig, RewardHeadConfig
from artlike_server.torch_worker.heads import SCORE_KEY, RewardHead, ValueHead
from artlike_server.torch_worker.precision import MasterWeights

REFERENCE_KEY = "reference"  # the PEFT adapter name of a reference step while it is in use
SCORER_KEY = "scorer"  # the PEFT adapter name of the reward model step that scores (`AdapterSlots.scorer`)
WEIGHTS_FILE = "adapter_model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"  # AdamW's state dict (tensors and numbers only: torch.load(weights_only=True))
CONFIG_FILE = "adapter_config.json"
STATE_FILE = "trainer_state.json"  # what an objective carries from step to step (PPO's KL coefficient)


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
    heads: dict[str, nn.Module] = field(default_factory=dict)  # "reward" (a reward model), "value" (PPO)
    state: dict[str, float] = field(default_factory=dict)  # the objective's state of the step loaded (STATE_FILE)

    def start_optimizer(
        self, parameters: list[torch.nn.Parameter], *, learning_rate: float, weight_decay: float
    ) -> torch.optim.Optimizer:
        """AdamW over fp32 master copies of `parameters` when they are low precision, else over them; each
        head is a group of its own."""
        self.master = MasterWeights(parameters) if MasterWeights.needed(parameters) else None
        self.optimizer = torch.optim.AdamW(
            self.master.parameters if self.master is not None else parameters,
            lr=learning_rate,
            weight_decay=weight_decay,
        )
        for head in self.heads.values():
            self.optimizer.add_param_group({"params": list(head.parameters())})
        return self.optimizer

    def add_head(self, name: str, head: nn.Module) -> None:
        """Give the slot a head (trained from now on by its own optimizer group)."""
        self.heads[name] = head
        if self.optimizer is not None:
            self.optimizer.add_param_group({"params": list(head.parameters())})

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
        self._device = next(base_model.parameters()).device
        self.hidden_size = int(base_model.config.hidden_size)
        self._scorer: tuple[Path, float, peft.LoraConfig, RewardHead] | None = None  # dir, mtime, config, head

    @property
    def model(self) -> PeftModel:
        if self._model is None:
            raise AdapterError("no adapter has been created or loaded yet")
        return self._model

    def slot(self, model_name: str) -> AdapterSlot:
        return self._slots[model_name]

    def create(self, model_name: str, config: peft.LoraConfig, *, seed: int,
               reward_head: RewardHeadConfig | None = None) -> AdapterSlot:
        """A fresh adapter (lora_B = 0: outputs equal the base model's), replacing any previous one of that name;
        with `reward_head`, a reward model's adapter with a freshly initialised score head."""
        key = f"m{self._next_key}"
        self._next_key += 1
        # PEFT draws lora_A from the global generator; seeding it makes a registration reproducible.
        torch.manual_seed(seed)
        self._add_adapter(key, config)
        previous = self._slots.get(model_name)
        if previous is not None:
            self.model.delete_adapter(previous.key)
        slot = AdapterSlot(key=key, config=config)
        if reward_head is not None:
            slot.heads["reward"] = RewardHead(self.hidden_size, reward_head, seed=seed).to(self._device)
        self._slots[model_name] = slot
        self.activate(model_name)
        return slot

    def _add_adapter(self, key: str, config: peft.LoraConfig) -> None:
        # Adapters in the base model's dtype (no fp32 upcast): see training.precision.
        if self._model is None:
            self._model = get_peft_model(self._base, config, adapter_name=key, autocast_adapter_dtype=False)
        else:
            self._model.add_adapter(key, config, autocast_adapter_dtype=False)

    def value_head(self, model_name: str) -> ValueHead:
        """The model's value head, created (zero) the first time a job asks for it."""
        slot = self._slots[model_name]
        head = slot.heads.get("value")
        if not isinstance(head, ValueHead):
            head = ValueHead(self.hidden_size).to(self._device)
            slot.add_head("value", head)
        return head

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
        heads = self._read_heads(adapter_dir, weights)
        slot = self._slots.get(model_name)
        if slot is None or _shape_of(slot.config) != _shape_of(config) or _head_shapes(slot.heads) != _head_shapes(heads):
            slot = self.create(model_name, config, seed=0)
            slot.heads = heads
        self.activate(model_name)
        slot.state = read_state(adapter_dir)
        current = get_peft_model_state_dict(self.model, adapter_name=slot.key)
        if current.keys() != weights.keys():
            missing = sorted(set(current) ^ set(weights))[:3]
            raise AdapterError(f"{adapter_dir} does not match its adapter_config.json (e.g. {missing})")
        same_heads = all(_same_weights(slot.heads[name], head) for name, head in heads.items())
        if not same_heads or not all(torch.equal(weights[k].to(current[k].dtype), current[k]) for k in current):
            result: Any = set_peft_model_state_dict(self.model, weights, adapter_name=slot.key)
            if result.unexpected_keys:
                raise AdapterError(f"{adapter_dir} has unexpected keys, e.g. {result.unexpected_keys[:3]}")
            slot.heads = heads  # a step without a value head drops the one in memory too
            slot.drop_optimizer()
        return slot

    def _read_heads(self, adapter_dir: Path, weights: dict[str, torch.Tensor]) -> dict[str, nn.Module]:
        """The heads saved with a step (the score weight is taken out of `weights`)."""
        heads: dict[str, nn.Module] = {}
        try:
            reward = RewardHead.load(adapter_dir, weights, self.hidden_size, self._device)
            value = ValueHead.load(adapter_dir, self.hidden_size, self._device)
        except (ValueError, KeyError, RuntimeError) as error:
            raise AdapterError(f"{adapter_dir}: a head does not fit the base model ({error})") from None
        weights.pop(SCORE_KEY, None)
        if reward is not None:
            heads["reward"] = reward
        if value is not None:
            heads["value"] = value
        return heads

    def save(self, model_name: str, out_dir: Path, *, with_optimizer: bool = False,
             state: Mapping[str, float] | None = None) -> Path:
        """Write the adapter as a PEFT directory at `out_dir` (absent or an empty directory), atomically, with
        its heads (`heads.py`) and the objective `state` to carry into the next job (`STATE_FILE`);
        `with_optimizer`: its AdamW state beside it (`OPTIMIZER_FILE`), to resume training from it exactly."""
        slot = self._slots[model_name]
        out_dir = Path(out_dir)
        check_writable(out_dir)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
        try:
            weights = {k: v.detach().contiguous()
                       for k, v in get_peft_model_state_dict(self.model, adapter_name=slot.key).items()}
            config = copy.deepcopy(slot.config)
            reward = slot.heads.get("reward")
            if isinstance(reward, RewardHead):
                weights.update(reward.state())
                reward.save_config(tmp)
                config.task_type = "SEQ_CLS"  # PEFT then loads it onto AutoModelForSequenceClassification
                config.modules_to_save = ["score"]
            value = slot.heads.get("value")
            if isinstance(value, ValueHead):
                value.save(tmp)
            save_file(weights, str(tmp / WEIGHTS_FILE))
            if with_optimizer and slot.optimizer is not None:
                torch.save(slot.optimizer.state_dict(), tmp / OPTIMIZER_FILE)
            carried = dict(slot.state if state is None else state)
            if carried:
                (tmp / STATE_FILE).write_bytes(orjson.dumps(carried))
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

    @contextmanager
    def scorer(self, adapter_dir: Path) -> Iterator[RewardHead]:
        """Within the block the model is the reward model step at `adapter_dir` (eval mode, its score head
        yielded); afterwards the adapter that was active is again. The step stays resident for the next call."""
        adapter_dir = Path(adapter_dir)
        stamp = (adapter_dir / WEIGHTS_FILE).stat().st_mtime if (adapter_dir / WEIGHTS_FILE).is_file() else 0.0
        if self._scorer is None or self._scorer[:2] != (adapter_dir, stamp):
            config = _read_config(adapter_dir)
            weights = _read_weights(adapter_dir)
            heads = self._read_heads(adapter_dir, weights)
            head = heads.get("reward")
            if not isinstance(head, RewardHead):
                raise AdapterError(f"{adapter_dir} is not a reward model step (no score head)")
            if self._scorer is not None and _shape_of(self._scorer[2]) != _shape_of(config):
                self.model.delete_adapter(SCORER_KEY)
                self._scorer = None
            if self._scorer is None:
                self._add_adapter(SCORER_KEY, config)
            result: Any = set_peft_model_state_dict(self.model, weights, adapter_name=SCORER_KEY)
            if result.unexpected_keys:
                raise AdapterError(f"{adapter_dir} has unexpected keys, e.g. {result.unexpected_keys[:3]}")
            self._scorer = (adapter_dir, stamp, config, head)
        active = self.model.active_adapter
        was_training = self.model.training
        self.model.set_adapter(SCORER_KEY)
        self.model.eval()
        try:
            yield self._scorer[3]
        finally:
            self.model.train(was_training)
            if active != SCORER_KEY and active in self.model.peft_config:
                self.model.set_adapter(active)

    def parameters(self, model_name: str) -> list[torch.nn.Parameter]:
        key = self._slots[model_name].key
        return [p for name, p in self.model.named_parameters() if f".{key}." in name]


def check_writable(out_dir: Path) -> None:
    """Adapters are never overwritten: `out_dir` must not exist or be an empty directory."""
    if out_dir.exists() and not (out_dir.is_dir() and not any(out_dir.iterdir())):
        raise AdapterError(
            f"{out_dir} already exists and is not an empty directory; adapters are never overwritten"
        )


def read_state(adapter_dir: Path) -> dict[str, float]:
    """The objective state saved with a step ({} when none)."""
    path = Path(adapter_dir) / STATE_FILE
    if not path.is_file():
        return {}
    raw = orjson.loads(path.read_bytes())
    return {str(k): float(v) for k, v in raw.items()} if isinstance(raw, dict) else {}


def _head_shapes(heads: Mapping[str, nn.Module]) -> dict[str, tuple[tuple[int, ...], ...]]:
    return {name: tuple(tuple(p.shape) for p in head.parameters()) for name, head in heads.items()}


def _same_weights(first: nn.Module, second: nn.Module) -> bool:
    return all(torch.equal(a, b) for a, b in zip(first.parameters(), second.parameters(), strict=True))


def _read_config(adapter_dir: Path) -> peft.LoraConfig:
    if not (Path(adapter_dir) / CONFIG_FILE).is_file():
        raise AdapterError(f"{adapter_dir} has no {CONFIG_FILE}")
    config: peft.LoraConfig = peft.LoraConfig.from_pretrained(str(adapter_dir))
    config.inference_mode = False
    # A reward model's step names its score head for PEFT's SEQ_CLS loading; here the head lives apart.
    config.task_type = "CAUSAL_LM"
    config.modules_to_save = None
    return config


def _read_weights(adapter_dir: Path) -> dict[str, torch.Tensor]:
    path = Path(adapter_dir) / WEIGHTS_FILE
    if not path.is_file():
        raise AdapterError(f"{adapter_dir} has no {WEIGHTS_FILE}")
    return load_file(str(path))
