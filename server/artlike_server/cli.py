"""`artlike serve`: the OpenAI-compatible proxy in front of supervised (or remote) vLLM engines, with training."""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import urllib.parse
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated

import typer
import uvicorn

from .child_env import drop_secrets
from .data_dir_lock import DataDirInUse, DataDirLock
from .default_model import DEFAULT_MODEL_ID, ensure_default_model
from .dtype_choice import DtypeChoice, choose_dtypes
from .engine.launch import detect_device, parse_cpu_list
from .engine.placement import split_cpus
from .engine.pool_setup import remote_keys
from .engine.templates import resolve_chat_template
from .engine.tool_calling import choose_tool_calling
from .hardware import DTYPE_CHOICES, Role
from .hosts import ALLOW_ANY, HostPolicy
from .settings import ServerSettings

_MIB = 1024 * 1024

app = typer.Typer(add_completion=False, no_args_is_help=True, help="artlike: serve a model and train it with RL.")


@app.callback()
def _root() -> None:
    """artlike server commands."""


@app.command()
def serve(
    model: Annotated[str | None, typer.Option(help="A Hugging Face model directory (or hub id where a hub is "
                                              "reachable). Default: the embedded SmolLM2-135M-Instruct.")] = None,
    served_model_name: Annotated[str | None, typer.Option(help="The base model's id in the API.")] = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    data_dir: Annotated[Path, typer.Option(help="Adapters, history, completion log, logs.")] = Path("~/.artlike"),
    api_key: Annotated[str | None, typer.Option(
        envvar="ARTLIKE_API_KEY", help="Require this bearer token. Every local user can read a command line: prefer "
                                       "--api-key-file or the environment variable.")] = None,
    api_key_file: Annotated[Path | None, typer.Option(
        help="Read the API key from this file (its first line; keep it readable by this user only).")] = None,
    allowed_hosts: Annotated[list[str] | None, typer.Option(
        envvar="ARTLIKE_ALLOWED_HOSTS", help="A name this server is reached by besides localhost and IP addresses "
        "(repeatable, or comma-separated); requests naming any other host are refused, against DNS rebinding. "
        "The --host name is allowed by itself. '*' allows any name: unsafe without an API key.")] = None,
    forwarded_allow_ips: Annotated[str | None, typer.Option(
        help="Proxies whose X-Forwarded-For and X-Forwarded-Proto are trusted (comma-separated addresses, '*': "
             "any), e.g. 127.0.0.1 behind a TLS-terminating proxy on this machine: the studio page's cookie is "
             "then marked Secure for https requests. Default: none.")] = None,
    insecure_no_api_key: Annotated[bool, typer.Option(
        "--insecure-no-api-key", help="Serve a non-loopback --host without an API key: anyone who can reach "
        "the port can then generate, train and delete models.")] = False,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
    dtype: Annotated[str, typer.Option(
        help="Engine dtype: auto, bfloat16, float32. auto: bfloat16 on CUDA; on a CPU the faster of the two "
             "in a measured probe of the engine's GEMMs (bf16 needs >= 1.15x; ~3 s once per machine, cached: "
             "python -m artlike_server.dtype_probe), or the CPU flags where the probe cannot run.")] = "auto",
    trainer_dtype: Annotated[str, typer.Option(help="Trainer dtype: auto, bfloat16, float32 (auto as for "
                                               "--dtype, measured on the trainer's GEMMs).")] = "auto",
    max_loaded_adapters: Annotated[int, typer.Option(help="Latest K steps kept loaded in the engine.")] = 4,
    max_lora_rank: int = 64,
    max_model_len: int = 4096,
    kv_cache_gib: Annotated[float | None, typer.Option(
        help="KV cache size in GiB (default: 1 on CPU; on CUDA vLLM sizes it from free GPU memory).")] = None,
    chat_template: Annotated[str | None, typer.Option(
        help="A Jinja chat template file, or 'tool-chatml' for the built-in tool-capable ChatML template. "
             "Default: the model's own, or tool-chatml for a ChatML model whose template has no tools.")] = None,
    tool_call_parser: Annotated[str | None, typer.Option(
        help="vLLM tool-call parser (e.g. hermes, llama3_json, mistral), or 'none' to turn tool calling off. "
             "Default: picked from the model's chat template (engine/tool_calling.py).")] = None,
    engine_arg: Annotated[list[str] | None, typer.Option(help="Extra vLLM argument (repeatable).")] = None,
    engine_port: Annotated[int | None, typer.Option(help="Loopback port for vLLM (default: a free one).")] = None,
    engines: Annotated[int, typer.Option(
        min=0, help="Local vLLM engines to start and route between, each on its own cores (CPU: --engine-cpus split "
                    "evenly) or GPUs (CUDA: tensor x pipeline x data parallel size of --engine-arg each). 0: only "
                    "--engine-url engines.")] = 1,
    policy_engines: Annotated[int, typer.Option(
        min=0, help="Local engines that serve the model being trained from merged weights instead of a LoRA adapter "
                    "(rollouts 1.54x as fast on 2 CPU cores: bench/policy_engine.py). Each follows the last alias that moved "
                    "(or --policy-model), verified against the LoRA engines; they share --engine-cpus with the "
                    "--engines. See docs/scale-out.md.")] = 0,
    policy_model: Annotated[str | None, typer.Option(
        help="The model whose steps the --policy-engines serve (default: whichever model was trained last).")] = None,
    engine_url: Annotated[list[str] | None, typer.Option(
        help="A vLLM OpenAI server someone else runs, added to the rotation (repeatable). It must serve the same "
             "base model under the same name with runtime LoRA updating on, and read adapter directories by the "
             "paths this server sends (a shared filesystem at the same mount point). See docs/scale-out.md.")] = None,
    engine_key: Annotated[list[str] | None, typer.Option(
        envvar="ARTLIKE_ENGINE_KEY", help="The key --engine-url engines require: one for all, or one per URL in "
                                          "order (repeatable).")] = None,
    engine_key_file: Annotated[Path | None, typer.Option(
        help="Read the --engine-key values from this file instead, one a line.")] = None,
    engine_api_key: Annotated[str | None, typer.Option(
        envvar="ARTLIKE_ENGINE_API_KEY", help="The key vLLM requires on every route but /health. Default: a "
        "random one per engine start; set it only for tools that call vLLM directly (the benchmarks).")] = None,
    reject_seed: Annotated[bool | None, typer.Option(
        help="Reject per-request `seed` with a 400. Default: only on CPU with chunked prefill turned back on "
             "through --engine-arg, where a seeded request whose prefill is split crashes vLLM-CPU.")] = None,
    gradient_checkpointing: bool = False,
    engine_cpus: Annotated[str | None, typer.Option(
        help="CPU only: the cores the engine's threads run on, e.g. 0 or 0-5 (default: all; docs/pipeline.md "
             "measures a split against sharing).")] = None,
    trainer_cpus: Annotated[str | None, typer.Option(
        help="CPU only: the cores the trainer runs on, e.g. 1 or 6-7 (default: all). Disjoint from --engine-cpus, "
             "the trainer's threads spin-wait between parallel regions (faster steps) instead of sleeping.")] = None,
    trainer_gpus: Annotated[str | None, typer.Option(
        help="CUDA only: the GPUs the trainer uses, e.g. 1 or 2-3; several run it under torchrun, one rank per "
             "GPU (docs/multi-gpu-training.md). Default: the first visible one.")] = None,
    max_recorded_choices: Annotated[int, typer.Option(
        min=1, help="Largest `n` of one request through a trajectory URL (each choice is a log row).")] = 16,
    max_request_tokens: Annotated[int, typer.Option(
        min=1, help="Most output token entries one completion request may ask for: n x max_tokens (the model's "
                    "length when absent) x (1 + top_logprobs); bounds the engine answer the server reads.")
    ] = 16 * 4096 * 21,
    max_train_records: Annotated[int, typer.Option(
        min=1, help="Most recorded completions one /_train_model request may read.")] = 16_384,
    max_train_mb: Annotated[float, typer.Option(
        min=0.001, help="Most MiB of recorded token ids and logprobs one /_train_model request may read.")] = 128,
    max_gradient_steps: Annotated[int, typer.Option(
        min=1, help="Most optimizer steps (epochs x gradient_steps_per_epoch) of one training job.")] = 1024,
    max_sequence_tokens: Annotated[int | None, typer.Option(
        min=1, help="Longest training sequence in tokens (default: --max-model-len).")] = None,
    log_retention_days: Annotated[float, typer.Option(
        min=0, help="Prune trajectories whose last completion is older than this many days (0: never).")] = 30,
    log_max_mb: Annotated[float, typer.Option(
        min=0, help="Prune least recently used trajectories while the completion log holds more MiB "
                    "(0: no size limit).")] = 0,
    log_file_max_mb: Annotated[float, typer.Option(
        min=0.001, help="engine.log and trainer.log rotate at this size in MiB.")] = 64,
    log_file_backups: Annotated[int, typer.Option(min=1, help="Rotated engine/trainer logs kept.")] = 3,
    reward_timeout: Annotated[float, typer.Option(
        min=0.1, help="Seconds one call of user reward code (reward_fn, grade, tools) may take in the sandbox.")] = 10.0,
    reward_workers: Annotated[int, typer.Option(min=1, help="Sandbox worker processes for user reward code.")] = 2,
    reward_memory_mb: Annotated[int, typer.Option(
        min=64, help="Memory of one sandbox worker in MiB (all its processes; without a writable cgroup, split "
                     "over its few processes' address spaces).")] = 1024,
    unsafe_user_code: Annotated[bool, typer.Option(
        "--unsafe-user-code", help="Run user code (reward functions, python graders, tools, next_turn) even where "
                                   "it cannot be isolated (no unshare, no user namespaces): it then runs as the "
                                   "server's own user, with its network and files. Refused otherwise.")] = False,
    grader_timeout: Annotated[float, typer.Option(
        min=0.1, help="Seconds one text grader (text_similarity, math_accuracy, format) may compute before its "
                      "worker is killed: graders/run answers 504, a job's sample scores 0.")] = 5.0,
    grader_workers: Annotated[int, typer.Option(min=1, help="Worker processes for the text graders.")] = 2,
    grader_memory_mb: Annotated[int, typer.Option(
        min=128, help="Address-space limit of one grader worker in MiB.")] = 1024,
    max_grader_chars: Annotated[int, typer.Option(
        min=1, help="Longest text a grader compares (the sample, a rendered input or reference), in characters.")
    ] = 20_000,
    tensorboard_dir: Annotated[Path | None, typer.Option(
        help="Also write every trained step's metrics as TensorBoard event files here (one run per model).")] = None,
    log_level: str = "info",
) -> None:
    """Serve the OpenAI API with recording and training (and the studio page at /ui)."""
    api_key = _one_secret(api_key, api_key_file, "--api-key")
    if engine_key_file is not None:
        if engine_key:
            raise typer.BadParameter("give --engine-key or --engine-key-file, not both", param_hint="--engine-key-file")
        engine_key = _secret_lines(engine_key_file, "--engine-key-file")
    # Read once, kept out of every child process's environment (child_env.py).
    drop_secrets(os.environ, [s for s in (api_key, engine_api_key, *(engine_key or ())) if s])
    try:
        HostPolicy.from_options(allowed_hosts or (), host)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="--allowed-hosts") from error
    if not api_key and ALLOW_ANY in " ".join(allowed_hosts or ()).replace(",", " ").split():
        typer.echo("artlike: WARNING: --allowed-hosts '*' without an API key: any web page the browser on this "
                   "machine opens can drive this server (DNS rebinding).", err=True)
    if not api_key and not is_loopback_host(host):
        if not insecure_no_api_key:
            typer.echo(f"artlike: refusing to serve on {host} without an API key: anyone who can reach it could "
                       "generate, train and delete models. Pass --api-key (or set ARTLIKE_API_KEY), bind "
                       "127.0.0.1, or pass --insecure-no-api-key if the network is trusted.", err=True)
            raise typer.Exit(2)
        typer.echo(f"artlike: WARNING: serving on {host} without an API key (--insecure-no-api-key): anyone who "
                   "can reach it can generate, train and delete models.", err=True)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpx2"):  # one line per engine health check or job rollout is noise (httpx2: openai's)
        logging.getLogger(noisy).setLevel(logging.WARNING)
    resolved_device = detect_device() if device == "auto" else device
    for option, value in (("--dtype", dtype), ("--trainer-dtype", trainer_dtype)):
        if value not in DTYPE_CHOICES:
            raise typer.BadParameter(f"must be one of {', '.join(DTYPE_CHOICES)}, not {value!r}", param_hint=option)
    cpus = {option: _cpu_list(value, option) for option, value in
            (("--engine-cpus", engine_cpus), ("--trainer-cpus", trainer_cpus))}
    urls = tuple(_engine_url(url) for url in engine_url or ())
    keys = tuple(engine_key or ())
    if engines == 0 and not urls:
        raise typer.BadParameter("with --engines 0, give at least one --engine-url", param_hint="--engines")
    try:
        remote_keys(urls, keys)
        if engines + policy_engines > 1 and resolved_device == "cpu":
            split_cpus(cpus["--engine-cpus"], engines + policy_engines)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="--engines/--engine-key") from error
    dtypes = _choose_dtypes(dtype, trainer_dtype, resolved_device)
    if model is None:
        typer.echo("artlike: preparing the embedded default model (first run converts it once)...", err=True)
        model_path = ensure_default_model()
        name = served_model_name or DEFAULT_MODEL_ID
    else:
        local = Path(model).expanduser()
        model_path = local.resolve() if local.is_dir() else Path(model)
        name = served_model_name or (local.name if local.is_dir() else model)
    tools = choose_tool_calling(Path(model_path), parser=tool_call_parser, chat_template=chat_template)
    if tools.parser is None:
        typer.echo(f"artlike: tool calling is off: {tools.reason}", err=True)
    else:
        which = tools.chat_template or "the model's own"
        typer.echo(f"artlike: tool calling on: parser {tools.parser}, {which} template ({tools.reason})", err=True)
    template: Path | None = None
    if tools.chat_template is not None:
        template = Path(resolve_chat_template(tools.chat_template)).expanduser().resolve()
        if not template.is_file():
            raise typer.BadParameter(f"no such chat template file: {template}", param_hint="--chat-template")
    settings = ServerSettings(
        model_path=model_path,
        served_model_name=name,
        data_dir=data_dir.expanduser().resolve(),
        host=host,
        port=port,
        api_key=api_key or None,
        allowed_hosts=tuple(allowed_hosts or ()),
        forwarded_allow_ips=forwarded_allow_ips or None,
        reject_seed=_seed_is_unsafe(resolved_device, engine_arg or []) if reject_seed is None else reject_seed,
        device=resolved_device,
        engine_dtype=dtypes["engine"].dtype,
        engine_dtype_source=dtypes["engine"].source,
        engine_port=engine_port,
        engines=engines,
        engine_urls=urls,
        engine_keys=keys,
        policy_engines=policy_engines,
        policy_model=policy_model,
        engine_api_key=engine_api_key or None,
        max_loaded_adapters=max_loaded_adapters,
        max_lora_rank=max_lora_rank,
        max_model_len=max_model_len,
        kv_cache_gib=kv_cache_gib if kv_cache_gib is not None else (1.0 if resolved_device == "cpu" else None),
        chat_template=template,
        tool_call_parser=tools.parser,
        engine_args=tuple(engine_arg or ()),
        engine_cpus=cpus["--engine-cpus"],
        trainer_cpus=cpus["--trainer-cpus"],
        trainer_gpus=_gpu_list(trainer_gpus, resolved_device),
        trainer_dtype=dtypes["trainer"].dtype,
        trainer_dtype_source=dtypes["trainer"].source,
        gradient_checkpointing=gradient_checkpointing,
        max_recorded_choices=max_recorded_choices,
        max_request_tokens=max_request_tokens,
        max_train_records=max_train_records,
        max_train_bytes=int(max_train_mb * _MIB),
        max_gradient_steps=max_gradient_steps,
        max_sequence_tokens=max_sequence_tokens,
        log_retention_days=log_retention_days or None,
        log_max_bytes=int(log_max_mb * _MIB) or None,
        log_file_max_bytes=int(log_file_max_mb * _MIB),
        log_file_backups=log_file_backups,
        reward_timeout_s=reward_timeout,
        reward_workers=reward_workers,
        reward_memory_bytes=reward_memory_mb * _MIB,
        unsafe_user_code=unsafe_user_code,
        grader_timeout_s=grader_timeout,
        grader_workers=grader_workers,
        grader_memory_bytes=grader_memory_mb * _MIB,
        max_grader_chars=max_grader_chars,
        tensorboard_dir=tensorboard_dir.expanduser().resolve() if tensorboard_dir else None,
    )
    raise typer.Exit(run(settings, log_level=log_level))


def _engine_url(url: str) -> str:
    """`url` without a trailing slash or /v1 (the proxy adds the paths); BadParameter unless http(s)://host."""
    parsed = urllib.parse.urlsplit(url.strip())
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise typer.BadParameter(f"must be an http(s) URL such as http://10.0.0.5:8000, not {url!r}",
                                 param_hint="--engine-url")
    path = parsed.path.rstrip("/")
    path = path.removesuffix("/v1")
    return urllib.parse.urlunsplit((parsed.scheme, parsed.netloc, path, "", ""))


def _one_secret(value: str | None, path: Path | None, option: str) -> str | None:
    """`value`, or the first line of the file `path` (`option`-file); BadParameter if both or the file is unusable."""
    if path is None:
        return value
    if value:
        raise typer.BadParameter(f"give {option} (or its environment variable) or {option}-file, not both",
                                 param_hint=f"{option}-file")
    lines = _secret_lines(path, f"{option}-file")
    if len(lines) != 1:
        raise typer.BadParameter(f"{path} must hold the key on one line", param_hint=f"{option}-file")
    return lines[0]


def _secret_lines(path: Path, option: str) -> list[str]:
    """The non-empty lines of a key file; a warning if other users may read it."""
    try:
        text = path.expanduser().read_text()
        mode = path.expanduser().stat().st_mode
    except OSError as error:
        raise typer.BadParameter(f"cannot read {path}: {error.strerror}", param_hint=option) from error
    if mode & 0o077:
        typer.echo(f"artlike: WARNING: {path} is readable by other users: chmod 600 it", err=True)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        raise typer.BadParameter(f"{path} is empty", param_hint=option)
    return lines


def _choose_dtypes(engine: str, trainer: str, device: str) -> dict[Role, DtypeChoice]:
    """Each role's dtype, said in the log; "auto" on a CPU runs the dtype probe (cached per machine)."""
    choices = choose_dtypes({"engine": engine, "trainer": trainer}, device)
    for role, choice in choices.items():
        typer.echo(f"artlike: {role} dtype {choice.describe()}", err=True)
    return choices


def is_loopback_host(host: str) -> bool:
    """Whether `host` binds loopback only. A name counts only if every address it resolves to is loopback
    (an unresolvable name is not loopback: refusing is the safe answer)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        addresses = {str(info[4][0]) for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def _cpu_list(value: str | None, option: str) -> tuple[int, ...] | None:
    """A --engine-cpus / --trainer-cpus value as core ids this process may run on (None when not given)."""
    if value is None:
        return None
    try:
        ids = parse_cpu_list(value)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint=option) from error
    usable = os.sched_getaffinity(0)
    if not set(ids) <= usable:
        raise typer.BadParameter(f"cores {sorted(set(ids) - usable)} are not available to this process "
                                 f"(usable: {sorted(usable)})", param_hint=option)
    return ids


def _gpu_list(value: str | None, device: str) -> tuple[int, ...] | None:
    """A --trainer-gpus value as device indices (None when not given); CUDA only."""
    if value is None:
        return None
    if device != "cuda":
        raise typer.BadParameter(f"needs a CUDA device, not {device!r}", param_hint="--trainer-gpus")
    try:
        return parse_cpu_list(value)  # the same list syntax: "0-2,5"
    except ValueError as error:
        raise typer.BadParameter(str(error).replace("CPU", "GPU"), param_hint="--trainer-gpus") from error


def _seed_is_unsafe(device: str, engine_args: list[str]) -> bool:
    # engine/launch.py turns chunked prefill off on CPU, which makes `seed` safe (DESIGN §8); an operator
    # who turns it back on gets seeded requests rejected instead of a crashed engine.
    return device == "cpu" and "--enable-chunked-prefill" in engine_args


class _Server(uvicorn.Server):
    """uvicorn's server, which runs `before_shutdown` first when it stops: its graceful shutdown waits for
    open responses, and a training stream stays open until its job ends unless the job is cancelled."""

    def __init__(self, config: uvicorn.Config, before_shutdown: Callable[[], Awaitable[None]]) -> None:
        super().__init__(config)
        self._before_shutdown = before_shutdown

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await self._before_shutdown()
        await super().shutdown(sockets)


def run(settings: ServerSettings, *, log_level: str = "info") -> int:
    try:
        lock = DataDirLock(settings.data_dir).acquire()  # before the engine: a second server exits at once
    except DataDirInUse as error:
        typer.echo(f"artlike: {error}", err=True)
        return 1
    try:
        return _serve(settings, log_level)
    finally:
        lock.release()


def _serve(settings: ServerSettings, log_level: str) -> int:
    from .app import begin_shutdown, create_app

    fatal: list[BaseException] = []
    # proxy_headers only with --forwarded-allow-ips: without a proxy to trust, uvicorn's X-Forwarded-* layer
    # would cost every request a trusted-host check on the hot path for nothing.
    trusted = settings.forwarded_allow_ips
    config = uvicorn.Config(None, host=settings.host, port=settings.port, log_level=log_level,  # type: ignore[arg-type]
                            timeout_graceful_shutdown=10, access_log=False, proxy_headers=trusted is not None,
                            forwarded_allow_ips=trusted)
    server = _Server(config, lambda: begin_shutdown(fastapi_app))

    def on_fatal(error: BaseException) -> None:
        fatal.append(error)
        server.should_exit = True

    config.app = fastapi_app = create_app(settings, on_fatal=on_fatal)
    typer.echo(f"artlike: serving {settings.served_model_name} on http://{settings.host}:{settings.port} "
               f"(data in {settings.data_dir}); the engine is starting, /health says when it is ready", err=True)
    server.run()
    return 1 if fatal else 0


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    app(args=argv)


if __name__ == "__main__":
    main()
