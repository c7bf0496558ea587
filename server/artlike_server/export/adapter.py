"""The `peft` format: the step's adapter files as they are, with `base_model_name_or_path` naming the base
model's id rather than the directory the trainer loaded it from (which only exists on this machine)."""

from __future__ import annotations

import shutil
from pathlib import Path

import orjson

from .source import StepSource

# Trainer-only files: the optimizer state and the objectives' carried state are of no use outside.
_TRAINER_ONLY = frozenset({"optimizer.pt", "trainer_state.json"})


def write_adapter(source: StepSource, out: Path) -> None:
    for path in sorted(source.step_dir.iterdir()):
        if path.is_file() and path.name not in _TRAINER_ONLY:
            shutil.copy2(path, out / path.name)
    config_path = out / "adapter_config.json"
    config = orjson.loads(config_path.read_bytes())
    config["base_model_name_or_path"] = source.base_model_id
    config_path.write_bytes(orjson.dumps(config, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))
