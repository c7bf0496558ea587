"""Everything `artlike serve` can be told, in sections, each field with its default and its help in one place.

`cli.py` derives the `serve` options from these fields (the flag is the field name in dashes unless a field
names its own; the help is its description; bounds come from `ge`), and each service is given only its
section. A few fields are resolved by the CLI before the server starts: `auto` devices and dtypes, the
KV cache size, `reject_seed`, the chat template and the tool-call parser.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from .hardware import Source

_MIB = 1024 * 1024


def option(default: Any, help: str, *, flag: str | None = None, envvar: str | None = None, cli: bool = True,
           **constraints: Any) -> Any:
    """A settings field: its default, its help, and how the command line names it (`flag`, `envvar`);
    `cli=False` for a value the server resolves at start rather than one an operator gives."""
    extra: dict[str, Any] = {"cli": cli}
    if flag is not None:
        extra["flag"] = flag
    if envvar is not None:
        extra["envvar"] = envvar
    return Field(default, description=help, json_schema_extra=extra, **constraints)


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class NetworkSettings(_Section):
    """Who may reach the server, and how."""

    host: str = option("127.0.0.1", "The address to listen on. Anything but loopback needs an API key "
                                    "(or --insecure-no-api-key).")
    port: int = option(8000, "The port to listen on.")
    api_key: str | None = option(None, "Require this bearer token. Every local user can read a command line: "
                                       "prefer --api-key-file or the environment variable.", envvar="ARTLIKE_API_KEY")
    allowed_hosts: tuple[str, ...] = option(
        (), "A name this server is reached by besides localhost and IP addresses (repeatable, or comma-separated); "
            "requests naming any other host are refused, against DNS rebinding. The --host name is allowed by "
            "itself. '*' allows any name: unsafe without an API key.", envvar="ARTLIKE_ALLOWED_HOSTS")
    forwarded_allow_ips: str | None = option(
        None, "Proxies whose X-Forwarded-For and X-Forwarded-Proto are trusted (comma-separated addresses, '*': "
              "any), e.g. 127.0.0.1 behind a TLS-terminating proxy on this machine: the studio page's cookie is "
              "then marked Secure for https requests. Default: none.")
    insecure_no_api_key: bool = option(
        False, "Serve a non-loopback --host without an API key: anyone who can reach the port can then generate, "
               "train and delete models.", flag="--insecure-no-api-key")


class LimitsSettings(_Section):
    """What one request may ask for: no request can fill the disk or the memory."""

    max_body_bytes: int = option(32 * _MIB, "Largest request body in bytes (413 beyond).", ge=1)
    reject_seed: bool | None = option(
        None, "Reject per-request `seed` with a 400. Default: only on CPU with chunked prefill turned back on "
              "through --engine-arg, where a seeded request whose prefill is split crashes vLLM-CPU.")
    max_recorded_choices: int = option(
        16, "Largest `n` of one request through a trajectory URL (each choice is a log row).", ge=1)
    max_request_tokens: int = option(
        16 * 4096 * 21, "Most output token entries one completion request may ask for: n x max_tokens (the model's "
                        "length when absent) x (1 + top_logprobs); bounds the engine answer the server reads.", ge=1)
    max_train_records: int = option(16_384, "Most recorded completions one /_train_model request may read.", ge=1)
    max_train_mb: float = option(
        128, "Most MiB of recorded token ids and logprobs one /_train_model request may read.", ge=0.001)
    max_gradient_steps: int = option(
        1024, "Most optimizer steps (epochs x gradient_steps_per_epoch) of one training job.", ge=1)
    max_sequence_tokens: int | None = option(
        None, "Longest training sequence in tokens (default: --max-model-len).", ge=1)

    @property
    def max_train_bytes(self) -> int:
        return int(self.max_train_mb * _MIB)


class RetentionSettings(_Section):
    """How long the server keeps what it records, and its log files."""

    log_retention_days: float = option(
        30, "Prune trajectories whose last completion is older than this many days (0: never).", ge=0)
    log_max_mb: float = option(
        0, "Prune least recently used trajectories while the completion log holds more MiB (0: no size limit).",
        ge=0)
    log_prune_interval_s: float = option(3600.0, "Seconds between two prunings of the completion log.",
                                         flag="--log-prune-interval", gt=0)
    log_file_max_mb: float = option(64, "engine.log and trainer.log rotate at this size in MiB.", ge=0.001)
    log_file_backups: int = option(3, "Rotated engine/trainer logs kept.", ge=1)

    @property
    def max_age_seconds(self) -> float | None:
        return self.log_retention_days * 86_400 if self.log_retention_days else None

    @property
    def max_log_bytes(self) -> int | None:
        return int(self.log_max_mb * _MIB) or None

    @property
    def log_file_max_bytes(self) -> int:
        return int(self.log_file_max_mb * _MIB)


class TrackerSettings(_Section):
    """Experiment trackers that see every trained step, evaluation, managed job, alias move and export."""

    tensorboard_dir: Path | None = option(
        None, "Also write every trained step's metrics as TensorBoard event files here (one run per model).")
    wandb_project: str | None = option(
        None, "Also log to this Weights & Biases project: one run per model with every step's metrics, "
              "evaluations, managed jobs' train configs, alias moves and exports. W&B's environment applies "
              "(WANDB_API_KEY, WANDB_MODE=offline, WANDB_DIR).")
    wandb_entity: str | None = option(None, "The W&B entity (user or team) of --wandb-project (default: W&B's).")
    wandb_run_name: str = option(
        "", "A prefix of each W&B run's name and id (the run of model M is PREFIX + M).")
    mlflow_tracking_uri: str | None = option(
        None, "Also log to this MLflow tracking server or store (http://..., databricks, file:DIR with "
              "MLFLOW_ALLOW_FILE_STORE=true): one run per model with the same records as --wandb-project.")
    mlflow_experiment: str = option("artlike", "The MLflow experiment the runs of --mlflow-tracking-uri go in.")


class EngineSettings(_Section):
    """The vLLM engines this server starts."""

    device: str = option("auto", "auto, cpu or cuda.")
    dtype: str = option(
        "auto", "Engine dtype: auto, bfloat16, float32. auto: bfloat16 on CUDA; on a CPU the faster of the two in "
                "a measured probe of the engine's GEMMs (cached once per machine: python -m "
                "artlike_server.dtype_probe), or the CPU flags where the probe cannot run.")
    dtype_source: Source = option("explicit", "How the dtype was chosen: explicit, probe, flags or cuda.", cli=False)
    port: int | None = option(None, "Loopback port for vLLM (default: a free one).", flag="--engine-port")
    api_key: str | None = option(
        None, "The key vLLM requires on every route but /health. Default: a random one per engine start; set it "
              "only for tools that call vLLM directly (the benchmarks).", flag="--engine-api-key",
        envvar="ARTLIKE_ENGINE_API_KEY")
    max_loaded_adapters: int = option(4, "Latest K steps kept loaded in the engine.")
    max_lora_rank: int = option(64, "Largest LoRA rank a model may be registered with.")
    max_model_len: int = option(4096, "Longest sequence (prompt and completion) in tokens.")
    kv_cache_gib: float | None = option(
        None, "KV cache size in GiB (default: 1 on CPU; on CUDA vLLM sizes it from free GPU memory).")
    chat_template: str | None = option(
        None, "A Jinja chat template file, or 'tool-chatml' for the built-in tool-capable ChatML template. "
              "Default: the model's own, or tool-chatml for a ChatML model whose template has no tools.")
    tool_call_parser: str | None = option(
        None, "vLLM tool-call parser (e.g. hermes, llama3_json, mistral), or 'none' to turn tool calling off. "
              "Default: picked from the model's chat template (engine/tool_calling.py).")
    args: tuple[str, ...] = option((), "Extra vLLM argument (repeatable).", flag="--engine-arg")
    startup_timeout_s: float = option(600.0, "Seconds an engine may take to start before it counts as failed.",
                                      flag="--engine-startup-timeout", gt=0)
    cpus: tuple[int, ...] | None = option(
        None, "CPU only: the cores the engine's threads run on, e.g. 0 or 0-5 (default: all; docs/pipeline.md "
              "measures a split against sharing).", flag="--engine-cpus")


class ScaleOutSettings(_Section):
    """More engines: local ones on their own cores or GPUs, and ones others run."""

    engines: int = option(
        1, "Local vLLM engines to start and route between, each on its own cores (CPU: --engine-cpus split "
           "evenly) or GPUs (CUDA: tensor x pipeline x data parallel size of --engine-arg each). 0: only "
           "--engine-url engines.", ge=0)
    engine_urls: tuple[str, ...] = option(
        (), "A vLLM OpenAI server someone else runs, added to the rotation (repeatable). It must serve the same "
            "base model under the same name with runtime LoRA updating on, and read adapter directories by the "
            "paths this server sends (a shared filesystem at the same mount point). See docs/scale-out.md.",
        flag="--engine-url")
    engine_keys: tuple[str, ...] = option(
        (), "The key --engine-url engines require: one for all, or one per URL in order (repeatable).",
        flag="--engine-key", envvar="ARTLIKE_ENGINE_KEY")
    policy_engines: int = option(
        0, "Local engines that serve the model being trained from merged weights instead of a LoRA adapter "
           "(faster rollouts: bench/policy_engine.py). Each follows the last alias that moved (or --policy-model), "
           "verified against the LoRA engines; they share --engine-cpus with the --engines. "
           "See docs/scale-out.md.", ge=0)
    policy_model: str | None = option(
        None, "The model whose steps the --policy-engines serve (default: whichever model was trained last).")

    @property
    def local_engines(self) -> int:
        return self.engines + self.policy_engines


class TrainerSettings(_Section):
    """The torch process that trains adapters."""

    dtype: str = option("auto", "Trainer dtype: auto, bfloat16, float32 (auto as for --dtype, measured on the "
                                "trainer's GEMMs).", flag="--trainer-dtype")
    dtype_source: Source = option("explicit", "How the dtype was chosen: explicit, probe, flags or cuda.", cli=False)
    gradient_checkpointing: bool = option(False, "Recompute activations in the backward pass (less memory).")
    fuse_passes: bool = option(
        True, "Run the passes of several training sessions that wait at once as one pass, each sequence through its "
              "own session's adapter (docs/tinker.md).")
    cpus: tuple[int, ...] | None = option(
        None, "CPU only: the cores the trainer runs on, e.g. 1 or 6-7 (default: all). Disjoint from --engine-cpus, "
              "the trainer's threads spin-wait between parallel regions (faster steps) instead of sleeping.",
        flag="--trainer-cpus")
    gpus: tuple[int, ...] | None = option(
        None, "CUDA only: the GPUs the trainer uses, e.g. 1 or 2-3; several run it under torchrun, one rank per "
              "GPU (docs/multi-gpu-training.md). Default: the first visible one.", flag="--trainer-gpus")


class SandboxSettings(_Section):
    """Where user code (reward functions, python graders, tools) and the text graders run."""

    reward_timeout_s: float = option(
        10.0, "Seconds one call of user reward code (reward_fn, grade, tools) may take in the sandbox.",
        flag="--reward-timeout", ge=0.1)
    reward_workers: int = option(2, "Sandbox worker processes for user reward code.", ge=1)
    reward_memory_mb: int = option(
        1024, "Memory of one sandbox worker in MiB (all its processes; without a writable cgroup, split over its "
              "few processes' address spaces).", ge=64)
    unsafe_user_code: bool = option(
        False, "Run user code (reward functions, python graders, tools, next_turn) even where it cannot be "
               "isolated (no unshare, no user namespaces): it then runs as the server's own user, with its network "
               "and files. Refused otherwise.", flag="--unsafe-user-code")
    grader_timeout_s: float = option(
        5.0, "Seconds one text grader (text_similarity, math_accuracy, format) may compute before its worker is "
             "killed: graders/run answers 504, a job's sample scores 0.", flag="--grader-timeout", ge=0.1)
    grader_workers: int = option(2, "Worker processes for the text graders.", ge=1)
    grader_memory_mb: int = option(1024, "Address-space limit of one grader worker in MiB.", ge=128)
    max_grader_chars: int = option(
        20_000, "Longest text a grader compares (the sample, a rendered input or reference), in characters.", ge=1)

    @property
    def reward_memory_bytes(self) -> int:
        return self.reward_memory_mb * _MIB

    @property
    def grader_memory_bytes(self) -> int:
        return self.grader_memory_mb * _MIB


SECTIONS: dict[str, type[_Section]] = {
    "network": NetworkSettings, "limits": LimitsSettings, "retention": RetentionSettings, "trackers": TrackerSettings,
    "engine": EngineSettings, "scale_out": ScaleOutSettings, "trainer": TrainerSettings, "sandbox": SandboxSettings,
}


class ServerSettings(BaseModel):
    """One server: the model it serves, where it keeps its data, and each part's section."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_path: Path = Field(description="A Hugging Face model directory (the converted default model if none "
                                         "was given), or a hub id.")
    served_model_name: str = Field(description="The base model's id in the OpenAI API.")
    data_dir: Path = Field(Path("~/.artlike"), description="Adapters, history, completion log, logs.")
    network: NetworkSettings = NetworkSettings()
    limits: LimitsSettings = LimitsSettings()
    retention: RetentionSettings = RetentionSettings()
    trackers: TrackerSettings = TrackerSettings()
    engine: EngineSettings = EngineSettings()
    scale_out: ScaleOutSettings = ScaleOutSettings()
    trainer: TrainerSettings = TrainerSettings()
    sandbox: SandboxSettings = SandboxSettings()

    @property
    def log_dir(self) -> Path:
        return self.data_dir / "logs"

    @property
    def sequence_token_limit(self) -> int:
        return self.limits.max_sequence_tokens or self.engine.max_model_len
