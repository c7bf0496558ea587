"""A step to export, found in the data dir directly (a running server is not needed, and not disturbed:
steps are immutable once committed).

The base weights are found from the step's own `adapter_config.json` (the trainer writes the directory it
loaded), then the embedded default model, then the model's base id as a hub id; `base_path` overrides all.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from artlike.types import LoraConfig, ModelKind, RewardHeadConfig

from ..default_model import DEFAULT_MODEL_ID, ensure_default_model
from ..errors import InvalidRequest, NotFound
from ..models.manager import parse_model_reference
from ..models.store import ModelStore


@dataclass(frozen=True)
class StepSource:
    name: str
    step: int
    step_dir: Path  # the PEFT adapter directory
    base_model_id: str  # the base as the model was registered (a hub id for the embedded model)
    base_path: Path  # where the base weights are read (a directory, or a hub id)
    kind: ModelKind
    lora: LoraConfig
    reward_head: RewardHeadConfig | None
    history: list[dict[str, Any]]  # the model's history lines up to and including this step

    @property
    def reference(self) -> str:
        return f"{self.name}@{self.step}"


def find_step(data_dir: Path, reference: str, *, base_path: Path | None = None) -> StepSource:
    """The committed step `reference` (`name@N`, or `name`: the step its alias serves) names."""
    store = ModelStore(data_dir)
    name, step = parse_model_reference(reference)
    model = store.get(name)
    if model is None:
        raise NotFound(f"model {name!r} does not exist in {data_dir}", param="model", code="model_not_found")
    committed = store.committed_steps(name)
    if not committed:
        raise NotFound(f"model {name!r} has no committed step", param="model", code="model_not_found")
    if step is None:
        step = model.alias_step if model.alias_step in committed else committed[-1]
    elif step not in committed:
        raise NotFound(f"model {name!r} has no step {step} (kept steps: {', '.join(map(str, committed))})",
                       param="model", code="model_not_found")
    step_dir = store.step_dir(name, step)
    history = [line for line in store.read_history(name)
               if not isinstance(line.get("step"), int) or line["step"] <= step]
    return StepSource(name=name, step=step, step_dir=step_dir, base_model_id=model.base_model,
                      base_path=base_path or _base_weights(step_dir, model.base_model), kind=model.kind,
                      lora=model.lora, reward_head=model.reward_head, history=history)


def _base_weights(step_dir: Path, base_model_id: str) -> Path:
    try:
        written = orjson.loads((step_dir / "adapter_config.json").read_bytes()).get("base_model_name_or_path")
    except (OSError, orjson.JSONDecodeError) as error:
        raise InvalidRequest(f"{step_dir} holds no readable adapter_config.json ({error})", param="model",
                             code="invalid_step") from error
    if written and (Path(written) / "config.json").is_file():
        return Path(written)
    if base_model_id == DEFAULT_MODEL_ID:
        return ensure_default_model()
    local = Path(base_model_id).expanduser()
    return local if (local / "config.json").is_file() else Path(base_model_id)
