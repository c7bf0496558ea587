"""Everything `artlike serve` can be told, in one frozen object that the app and its parts read."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .hardware import Dtype


@dataclass(frozen=True)
class ServerSettings:
    model_path: Path  # a Hugging Face model directory (the converted default model if none was given)
    served_model_name: str  # the base model's id in the OpenAI API
    data_dir: Path
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_body_bytes: int = 32 * 1024 * 1024
    # A per-request `seed` can crash vLLM-CPU when chunked prefill is on (DESIGN §8); see cli.py.
    reject_seed: bool = False
    # engine
    device: str = "cpu"
    engine_dtype: Dtype = "float32"  # the CLI resolves "auto" to what this machine runs fast (hardware.py)
    engine_port: int | None = None
    engine_api_key: str | None = None  # None: a random key per engine start (see engine/supervisor.py)
    max_loaded_adapters: int = 4
    max_lora_rank: int = 64
    max_model_len: int | None = 4096
    kv_cache_gib: float | None = 1.0
    chat_template: Path | None = None
    tool_call_parser: str | None = None
    engine_args: tuple[str, ...] = field(default_factory=tuple)
    engine_startup_timeout_s: float = 600.0
    # trainer
    trainer_dtype: Dtype = "float32"
    gradient_checkpointing: bool = False

    @property
    def log_dir(self) -> Path:
        return self.data_dir / "logs"
