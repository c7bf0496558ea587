"""The suite's stand-in for the default model: the embedded model cut to its first few decoder layers.

It keeps the embedded model's tokenizer, chat template, embeddings and the shapes of every LoRA target, so
requests, recording, adapters, swaps, exports and training steps run exactly as they do on the full model,
while each forward and backward pass costs a fraction as much (4 of 30 layers). It knows nothing, though:
what it says is noise, so a test whose assertion needs a sensible answer uses the full model.

`use_small_default_model()` writes the cut once (like the default model: into a temporary directory, then
renamed) into a cache of its own beside the real one, and points `ARTLIKE_CACHE_DIR` there, so that the
server, the examples and the documented snippets, which all ask for the default model, get the stand-in in
this process and in every child it starts."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from artlike_server.default_model import cache_dir, ensure_default_model, write_model_dir_once
from safetensors.numpy import load_file, save_file

SMALL_MODEL_LAYERS = 4
_COPIED_FILES = ("chat_template.jinja", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def _layer_index(weight_name: str) -> int | None:
    parts = weight_name.split(".")
    return int(parts[2]) if parts[:2] == ["model", "layers"] else None


def write_cut_model(source: Path, out: Path, layers: int) -> None:
    """`source`'s first `layers` decoder layers as a model directory in `out`."""
    weights = load_file(str(source / "model.safetensors"))
    kept = {name: tensor for name, tensor in weights.items()
            if (index := _layer_index(name)) is None or index < layers}
    save_file(kept, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in _COPIED_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, out / name)


FULL_CACHE_ENV = "ARTLIKE_TESTS_FULL_CACHE_DIR"


def use_small_default_model(layers: int = SMALL_MODEL_LAYERS) -> Path:
    """Makes the stand-in this process's default model; returns the cache dir that holds the full one.

    Its children inherit both (pytest-xdist's workers call this again: the full model's cache stays the one
    the first call found)."""
    full_cache = Path(os.environ.setdefault(FULL_CACHE_ENV, str(cache_dir())))
    os.environ["ARTLIKE_CACHE_DIR"] = str(full_cache)  # ensure_default_model below: the full one
    full_model = ensure_default_model()
    stand_in_cache = full_cache / f"tests-{layers}-layers"
    write_model_dir_once(stand_in_cache / "models" / full_model.name,
                         lambda out: write_cut_model(full_model, out, layers))
    os.environ["ARTLIKE_CACHE_DIR"] = str(stand_in_cache)
    return full_cache
