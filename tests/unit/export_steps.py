"""A data dir holding trained-looking steps of the embedded model, laid out by the server's own code (the
model store, and the trainer's adapter slots that write a step), without a server: a policy with steps 0
and 1 and a reward model with step 1. Step 1's LoRA B weights are random (a fresh adapter is the base)."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from artlike_server.default_model import DEFAULT_MODEL_ID, ensure_default_model
from artlike_server.models.store import ModelStore
from artlike_server.torch_worker.adapters import AdapterSlots, peft_lora_config
from transformers import AutoModelForCausalLM

from artlike.types import LoraConfig, RewardHeadConfig

POLICY, REWARD = "pol", "rm"
REWARD_HEAD = RewardHeadConfig(num_objectives=2, objective_names=["helpful", "brief"])
# Large enough that step 1 changes what the suite's stand-in model (tests/small_model.py) says greedily.
LORA_B_SCALE = 0.1


def _history_line(step: int, reward: float) -> dict[str, object]:
    return {"step": step, "from_step": step - 1, "time": time.time(), "trajectories": 8,
            "reward": {"mean": reward, "std": 0.1, "min": 0.0, "max": 1.0}, "loss": {"mean": 0.25},
            "kl": {"mean": 0.01}, "metrics": {"accuracy": 0.75}, "promoted": True}


def build_data_dir(data_dir: Path) -> Path:
    base = ensure_default_model()
    store = ModelStore(data_dir)
    lora = LoraConfig(rank=4, alpha=8.0)
    for name, head in ((POLICY, None), (REWARD, REWARD_HEAD)):
        slots = AdapterSlots(AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32), str(base))
        slots.create(name, peft_lora_config(lora, str(base)), seed=0, reward_head=head)
        store.create(name, DEFAULT_MODEL_ID, lora, kind="reward" if head else "policy", reward_head=head)
        store.commit_step(name, slots.save(name, store.new_staging_dir(name) / "s"), 0)
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for parameter_name, parameter in slots.model.named_parameters():
                if "lora_B" in parameter_name:
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * LORA_B_SCALE)
        store.commit_step(name, slots.save(name, store.new_staging_dir(name) / "s"), 1)
        store.append_history(name, _history_line(1, 0.5))
        store.append_history(name, {"event": "eval", "step": 1, "split": "held_out", "eval": {"accuracy": 0.8},
                                    "time": time.time()})
    return data_dir
