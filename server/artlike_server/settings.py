"""Everything `artlike serve` can be told, in one frozen object that the app and its parts read."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .hardware import Dtype, Source


@dataclass(frozen=True)
class ServerSettings:
    model_path: Path  # a Hugging Face model directory (the converted default model if none was given)
    served_model_name: str  # the base model's id in the OpenAI API
    data_dir: Path
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    # names a request's Host may carry besides loopback and IP addresses ("*": any); hosts.py
    allowed_hosts: tuple[str, ...] = ()
    # proxies whose X-Forwarded-For/-Proto uvicorn trusts (a comma list, "*": any; None: none)
    forwarded_allow_ips: str | None = None
    max_body_bytes: int = 32 * 1024 * 1024
    # A per-request `seed` can crash vLLM-CPU when chunked prefill is on (DESIGN §8); see cli.py.
    reject_seed: bool = False
    # limits (issue #11): no request can fill the disk or memory
    max_recorded_choices: int = 16  # `n` of one request through a trajectory URL
    # n x max_tokens x (1 + top_logprobs) of one completion request: bounds the engine JSON the proxy reads
    max_request_tokens: int = 16 * 4096 * 21
    max_train_records: int = 16_384  # recorded completions one /_train_model may read
    max_train_bytes: int = 128 * 1024 * 1024  # their stored token ids + logprobs (~9x that as Python lists)
    max_gradient_steps: int = 1024  # epochs x gradient_steps_per_epoch of one job
    max_sequence_tokens: int | None = None  # a training sequence's length; None: max_model_len
    # retention: whole trajectories whose last completion is older, then LRU ones over the size (None: no limit)
    log_retention_days: float | None = 30.0
    log_max_bytes: int | None = None
    log_prune_interval_s: float = 3600.0
    log_file_max_bytes: int = 64 * 1024 * 1024  # engine.log / trainer.log rotate at this size
    log_file_backups: int = 3
    # engine
    device: str = "cpu"
    engine_dtype: Dtype = "float32"  # the CLI resolves "auto" to what this machine runs fast (hardware.py)
    engine_dtype_source: Source = "explicit"  # how: explicit, probe (measured), flags (fallback) or cuda
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
    # scale-out (engine/pool.py): local engines this server starts, and engines others run (by URL, with keys)
    engines: int = 1
    engine_urls: tuple[str, ...] = ()
    engine_keys: tuple[str, ...] = ()  # none, one for every URL, or one per URL in order
    # merged-weights engines serving the training policy (engine/policy.py), and the model they follow
    policy_engines: int = 0
    policy_model: str | None = None  # None: whichever model's alias moved last
    # CPU: the cores the engine's and the trainer's threads run on (None: all of this process's)
    engine_cpus: tuple[int, ...] | None = None
    trainer_cpus: tuple[int, ...] | None = None
    # CUDA: the GPUs the trainer uses (None: the first visible); several: one torchrun rank each
    trainer_gpus: tuple[int, ...] | None = None
    # managed jobs: user reward code runs in a pool of sandboxed workers (jobs/sandbox.py)
    reward_timeout_s: float = 10.0
    reward_workers: int = 2
    reward_memory_bytes: int = 1 << 30
    unsafe_user_code: bool = False  # run user code even where it cannot be isolated (as the server's user)
    # graders' text work (text_similarity, math_accuracy, format) runs in killable workers (jobs/grader_pool.py)
    grader_timeout_s: float = 5.0
    grader_workers: int = 2
    grader_memory_bytes: int = 1 << 30
    max_grader_chars: int = 20_000  # each text a grader compares
    # per-step metrics also written as TensorBoard event files here (None: off)
    tensorboard_dir: Path | None = None
    # trainer
    trainer_dtype: Dtype = "float32"
    trainer_dtype_source: Source = "explicit"
    gradient_checkpointing: bool = False

    @property
    def log_dir(self) -> Path:
        return self.data_dir / "logs"

    @property
    def sequence_token_limit(self) -> int:
        return self.max_sequence_tokens or self.max_model_len or 4096
