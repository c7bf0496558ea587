"""A checked adapter as a step: the directory the engine and the trainer load, the history line that records
where it came from, and the rule for adding it to a model that exists."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from ..errors import Conflict, InvalidRequest
from ..models.store import StoredModel
from .check import CONFIG_FILE, WEIGHTS_FILE, CheckedAdapter


@dataclass(frozen=True)
class ImportedStep:
    model: str
    step: int
    created: bool  # the import created the model (its step 0)
    promoted: bool  # the alias `model` serves it

    def body(self, checked: CheckedAdapter) -> dict[str, Any]:
        """The route's answer (and what the command prints)."""
        return {"object": "trainable_model.step", "model": self.model, "step": self.step,
                "served_name": f"{self.model}@{self.step}", "created": self.created, "promoted": self.promoted,
                "lora": checked.lora.model_dump(), "dtypes": list(checked.dtypes), "modules": checked.modules}


def write_step(checked: CheckedAdapter, staging: Path, base_path: str) -> None:
    """The adapter's weights as they are, and its config naming the base directory this server loads (as the
    trainer writes its own steps); nothing else of the source directory comes along (a TRL checkpoint's
    `trainer_state.json` or `optimizer.pt` mean other things here)."""
    shutil.copyfile(checked.directory / WEIGHTS_FILE, staging / WEIGHTS_FILE)
    config = {**checked.config, "base_model_name_or_path": base_path, "inference_mode": True}
    (staging / CONFIG_FILE).write_bytes(orjson.dumps(config, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))
    for path in (staging / WEIGHTS_FILE, staging / CONFIG_FILE):
        os.chmod(path, 0o644)
    os.chmod(staging, 0o755)  # read by the engine and by people, as the trainer's steps are


def history_entry(step: int, checked: CheckedAdapter, *, promoted: bool, swap_seconds: float = 0.0) -> dict[str, Any]:
    """The line that commits an imported step (`"event": "import"`: not a trained step)."""
    return {"event": "import", "step": step, "time": time.time(), "promoted": promoted,
            "source": {"base_model_name_or_path": checked.source_base,
                       "peft_version": checked.config.get("peft_version")},
            "lora": checked.lora.model_dump(), "dtypes": list(checked.dtypes), "swap_seconds": swap_seconds}


def check_fits_model(model: StoredModel, checked: CheckedAdapter) -> None:
    """An adapter joins an existing model only as the same LoRA: the same rank, alpha and target modules, plain
    scaling (the model's steps are one line of weights to train on). Otherwise import it under a new name."""
    if model.kind != "policy":
        raise InvalidRequest(f"model {model.name!r} is a {model.kind} model; an imported adapter becomes a step "
                             "of a policy: import it under another name", param="model", code="not_a_policy")
    config = checked.config
    mine = (checked.lora.rank, checked.lora.alpha, sorted(checked.lora.target_modules))
    theirs = (model.lora.rank, model.lora.alpha, sorted({t.rsplit(".", 1)[-1] for t in model.lora.target_modules}))
    scaled_otherwise = bool(config.get("use_rslora") or config.get("rank_pattern") or config.get("alpha_pattern"))
    if mine != theirs or scaled_otherwise:
        extra = " with rsLoRA or per-module ranks" if scaled_otherwise else ""
        raise Conflict(f"model {model.name!r} is a LoRA of rank {theirs[0]}, alpha {theirs[1]:g} on "
                       f"{', '.join(theirs[2])}; the adapter is rank {mine[0]}, alpha {mine[1]:g} on "
                       f"{', '.join(mine[2])}{extra}: import it under another name", param="model",
                       code="lora_config_mismatch")
