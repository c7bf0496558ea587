"""`artlike serve`: the OpenAI-compatible proxy in front of supervised (or remote) vLLM engines, with training."""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import urllib.parse
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any

import typer
import uvicorn
from pydantic import ValidationError

from .child_env import drop_secrets
from .cli_options import settings_flags, with_options
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
from .settings import SECTIONS, EngineSettings, ServerSettings

DEFAULT_SERVER_URL = "http://127.0.0.1:8000"

app = typer.Typer(add_completion=False, no_args_is_help=True, help="artlike: serve a model and train it with RL.")


@app.callback()
def _root() -> None:
    """artlike server commands."""


def _command_only_options(
    model: Annotated[str | None, typer.Option(help="A Hugging Face model directory (or hub id where a hub is "
                                              "reachable). Default: the embedded SmolLM2-135M-Instruct.")] = None,
    served_model_name: Annotated[str | None, typer.Option(
        help=ServerSettings.model_fields["served_model_name"].description)] = None,
    data_dir: Annotated[Path, typer.Option(help=ServerSettings.model_fields["data_dir"].description)
                        ] = ServerSettings.model_fields["data_dir"].default,
    api_key_file: Annotated[Path | None, typer.Option(
        help="Read the API key from this file (its first line; keep it readable by this user only).")] = None,
    engine_key_file: Annotated[Path | None, typer.Option(
        help="Read the --engine-key values from this file instead, one a line.")] = None,
) -> None:
    """The options that are not settings: what to serve, and where secrets are read from."""


def _logging_options(log_level: str = "info") -> None:
    """How much the server logs."""


def serve(**options: Any) -> None:
    """Serve the OpenAI API with recording and training (and the studio page at /ui)."""
    given: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
    for flag in settings_flags():
        given[flag.section][flag.field] = options.pop(flag.param)
    network, engine, scale_out, trainer = given["network"], given["engine"], given["scale_out"], given["trainer"]
    network["api_key"] = _one_secret(network["api_key"], options["api_key_file"], "--api-key") or None
    engine_key_file = options["engine_key_file"]
    if engine_key_file is not None:
        if scale_out["engine_keys"]:
            raise typer.BadParameter("give --engine-key or --engine-key-file, not both", param_hint="--engine-key-file")
        scale_out["engine_keys"] = _secret_lines(engine_key_file, "--engine-key-file")
    engine["api_key"] = engine["api_key"] or None
    # Read once, kept out of every child process's environment (child_env.py).
    drop_secrets(os.environ, [s for s in (network["api_key"], engine["api_key"], *(scale_out["engine_keys"] or ()))
                              if s])
    _check_exposure(network)
    log_level = options["log_level"]
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpx2"):  # one line per engine health check or job rollout is noise (httpx2: openai's)
        logging.getLogger(noisy).setLevel(logging.WARNING)
    device = engine["device"] = detect_device() if engine["device"] == "auto" else engine["device"]
    for option, value in (("--dtype", engine["dtype"]), ("--trainer-dtype", trainer["dtype"])):
        if value not in DTYPE_CHOICES:
            raise typer.BadParameter(f"must be one of {', '.join(DTYPE_CHOICES)}, not {value!r}", param_hint=option)
    engine["cpus"] = _cpu_list(engine["cpus"], "--engine-cpus")
    trainer["cpus"] = _cpu_list(trainer["cpus"], "--trainer-cpus")
    trainer["gpus"] = _gpu_list(trainer["gpus"], device)
    engine["args"] = tuple(engine["args"] or ())
    urls = scale_out["engine_urls"] = tuple(_engine_url(url) for url in scale_out["engine_urls"] or ())
    keys = scale_out["engine_keys"] = tuple(scale_out["engine_keys"] or ())
    network["allowed_hosts"] = tuple(network["allowed_hosts"] or ())
    network["forwarded_allow_ips"] = network["forwarded_allow_ips"] or None
    local_engines = scale_out["engines"] + scale_out["policy_engines"]
    if scale_out["engines"] == 0 and not urls:
        raise typer.BadParameter("with --engines 0, give at least one --engine-url", param_hint="--engines")
    try:
        remote_keys(urls, keys)
        if local_engines > 1 and device == "cpu":
            split_cpus(engine["cpus"], local_engines)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="--engines/--engine-key") from error
    dtypes = _choose_dtypes(engine["dtype"], trainer["dtype"], device)
    engine["dtype"], engine["dtype_source"] = dtypes["engine"].dtype, dtypes["engine"].source
    trainer["dtype"], trainer["dtype_source"] = dtypes["trainer"].dtype, dtypes["trainer"].source
    if engine["kv_cache_gib"] is None and device == "cpu":
        engine["kv_cache_gib"] = 1.0  # on CUDA, vLLM sizes it from free GPU memory
    if given["limits"]["reject_seed"] is None:
        given["limits"]["reject_seed"] = _seed_is_unsafe(device, engine["args"])
    model_path, name = _model(options["model"], options["served_model_name"])
    engine["chat_template"], engine["tool_call_parser"] = _tool_calling(model_path, engine)
    trackers = given["trackers"]
    if trackers["tensorboard_dir"] is not None:
        trackers["tensorboard_dir"] = trackers["tensorboard_dir"].expanduser().resolve()
    settings = ServerSettings(model_path=model_path, served_model_name=name,
                              data_dir=options["data_dir"].expanduser().resolve(),
                              **{section: _section(section, values) for section, values in given.items()})
    raise typer.Exit(run(settings, log_level=log_level))


with_options(serve, before=_command_only_options, after=_logging_options)
app.command()(serve)


@app.command("export")
def export(
    model: Annotated[str, typer.Argument(help="MODEL or MODEL@STEP (MODEL alone: the step its alias serves).")],
    out: Annotated[Path, typer.Option(help="The directory to write (must not exist, or be empty).")],
    export_format: Annotated[str, typer.Option("--format", help="peft (the adapter), merged (Hugging Face weights) or gguf "
                                        "(llama.cpp, Ollama).")] = "merged",
    dtype: Annotated[str | None, typer.Option(help="merged: bfloat16 (default), float16 or float32.")] = None,
    quant: Annotated[str | None, typer.Option(help="gguf: the tensor type, as llama.cpp's converter's --outtype: "
                                              "f16 (default), bf16, f32 or q8_0.")] = None,
    data_dir: Annotated[Path, typer.Option(help=ServerSettings.model_fields["data_dir"].description)
                        ] = ServerSettings.model_fields["data_dir"].default,
    base_model: Annotated[Path | None, typer.Option(help="Read the base weights from this directory (default: "
                                                    "where the trainer read them, else the embedded model).")] = None,
) -> None:
    """Export a trained step: the PEFT adapter, the merged model, or a GGUF file, with a model card. Reads the
    data dir directly, whether a server is running on it or not."""
    from .errors import APIError
    from .export.formats import export_request
    from .export.run import export_step
    from .export.source import find_step

    try:
        request = export_request(export_format, dtype, quant)
        source = find_step(data_dir.expanduser().resolve(), model, base_path=base_model)
        written = export_step(source, request, out)
    except APIError as error:
        typer.echo(f"artlike export: {error.message}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"artlike: exported {source.reference} as {request.format} to {written}", err=True)


@app.command("import")
def import_adapter(
    adapter: Annotated[Path, typer.Argument(help="A PEFT LoRA adapter directory (adapter_config.json and "
                                            "adapter_model.safetensors) trained on the same base.")],
    model: Annotated[str, typer.Argument(help="The model it becomes a step of (created when it does not exist).")],
    data_dir: Annotated[Path, typer.Option(help=ServerSettings.model_fields["data_dir"].description)
                        ] = ServerSettings.model_fields["data_dir"].default,
    server: Annotated[str | None, typer.Option(envvar="ARTLIKE_SERVER", help="Import through this running server "
                                               "(default: ARTLIKE_SERVER; without it, the data dir is written "
                                               "directly, or through the server at "
                                               f"{DEFAULT_SERVER_URL} when one holds it).")] = None,
    api_key: Annotated[str | None, typer.Option(envvar="ARTLIKE_API_KEY", help="The server's API key.")] = None,
    base_model: Annotated[str | None, typer.Option(help="Without a server, a new model's base: a directory or "
                                                   "hub id (default: the embedded model). A server imports onto "
                                                   "the base it serves.")] = None,
    max_lora_rank: Annotated[int, typer.Option(help="Without a server, the largest rank accepted (a server "
                                               "applies its own --max-lora-rank).")
                             ] = EngineSettings.model_fields["max_lora_rank"].default,
    promote: Annotated[bool, typer.Option(help="Serve the step under the alias MODEL (an existing model).")] = True,
    any_base_name: Annotated[bool, typer.Option(help="Accept an adapter whose base_model_name_or_path names "
                                                "another model (its shapes are still checked against the "
                                                "base).")] = False,
) -> None:
    """Import a PEFT LoRA adapter trained elsewhere (TRL, Unsloth, PEFT) as a new step of MODEL, served as
    MODEL@N. Through a running server when one is given or holds the data dir, else into the data dir."""
    from .adapter_import.cli_run import ImportFailed, import_through_data_dir, import_through_server
    from .data_dir_lock import DataDirInUse

    directory = data_dir.expanduser().resolve()
    try:
        if server is None:
            try:
                answer = import_through_data_dir(adapter, model, directory, base_model=base_model,
                                                 max_lora_rank=max_lora_rank, promote=promote,
                                                 any_base_name=any_base_name)
            except DataDirInUse as error:
                typer.echo(f"artlike import: {error}; importing through the server at {DEFAULT_SERVER_URL} "
                           "(set ARTLIKE_SERVER or --server if it listens elsewhere)", err=True)
                server = DEFAULT_SERVER_URL
        if server is not None:
            answer = import_through_server(adapter, model, server, api_key=api_key, promote=promote,
                                           any_base_name=any_base_name)
    except ImportFailed as error:
        typer.echo(f"artlike import: {error}", err=True)
        raise typer.Exit(2) from None
    where = "" if server is not None else " (served when a server starts on the data dir)"
    typer.echo(f"artlike: imported {adapter} as {answer['served_name']}{where}", err=True)


def _section(section: str, values: dict[str, Any]) -> Any:
    """One settings section from the command's values; a value the section refuses names its option."""
    try:
        return SECTIONS[section](**values)
    except ValidationError as error:
        problem = error.errors()[0]
        flags = {flag.field: flag.decl for flag in settings_flags() if flag.section == section}
        raise typer.BadParameter(problem["msg"], param_hint=flags.get(str(problem["loc"][0]))) from error


def _check_exposure(network: dict[str, Any]) -> None:
    """Refuse (or warn about) a server that anyone on the network, or any web page, could drive."""
    api_key, host, allowed_hosts = network["api_key"], network["host"], network["allowed_hosts"]
    try:
        HostPolicy.from_options(allowed_hosts or (), host)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="--allowed-hosts") from error
    if not api_key and ALLOW_ANY in " ".join(allowed_hosts or ()).replace(",", " ").split():
        typer.echo("artlike: WARNING: --allowed-hosts '*' without an API key: any web page the browser on this "
                   "machine opens can drive this server (DNS rebinding).", err=True)
    if not api_key and not is_loopback_host(host):
        if not network["insecure_no_api_key"]:
            typer.echo(f"artlike: refusing to serve on {host} without an API key: anyone who can reach it could "
                       "generate, train and delete models. Pass --api-key (or set ARTLIKE_API_KEY), bind "
                       "127.0.0.1, or pass --insecure-no-api-key if the network is trusted.", err=True)
            raise typer.Exit(2)
        typer.echo(f"artlike: WARNING: serving on {host} without an API key (--insecure-no-api-key): anyone who "
                   "can reach it can generate, train and delete models.", err=True)


def _model(model: str | None, served_model_name: str | None) -> tuple[Path, str]:
    """The model's directory (or hub id) and its id in the API."""
    if model is None:
        typer.echo("artlike: preparing the embedded default model (first run converts it once)...", err=True)
        return ensure_default_model(), served_model_name or DEFAULT_MODEL_ID
    local = Path(model).expanduser()
    if local.is_dir():
        return local.resolve(), served_model_name or local.name
    return Path(model), served_model_name or model


def _tool_calling(model_path: Path, engine: dict[str, Any]) -> tuple[str | None, str | None]:
    """The chat template file and the tool-call parser the engine runs with, said in the log."""
    tools = choose_tool_calling(model_path, parser=engine["tool_call_parser"], chat_template=engine["chat_template"])
    if tools.parser is None:
        typer.echo(f"artlike: tool calling is off: {tools.reason}", err=True)
    else:
        which = tools.chat_template or "the model's own"
        typer.echo(f"artlike: tool calling on: parser {tools.parser}, {which} template ({tools.reason})", err=True)
    if tools.chat_template is None:
        return None, tools.parser
    template = Path(resolve_chat_template(tools.chat_template)).expanduser().resolve()
    if not template.is_file():
        raise typer.BadParameter(f"no such chat template file: {template}", param_hint="--chat-template")
    return str(template), tools.parser


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


def _seed_is_unsafe(device: str, engine_args: tuple[str, ...]) -> bool:
    # engine/launch.py turns chunked prefill off on CPU, which makes `seed` safe; an operator
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
    from .app import begin_shutdown, create_app_from_settings

    fatal: list[BaseException] = []
    # proxy_headers only with --forwarded-allow-ips: without a proxy to trust, uvicorn's X-Forwarded-* layer
    # would cost every request a trusted-host check on the hot path for nothing.
    network = settings.network
    trusted = network.forwarded_allow_ips
    config = uvicorn.Config(None, host=network.host, port=network.port, log_level=log_level,  # type: ignore[arg-type]
                            timeout_graceful_shutdown=10, access_log=False, proxy_headers=trusted is not None,
                            forwarded_allow_ips=trusted)
    server = _Server(config, lambda: begin_shutdown(fastapi_app))

    def on_fatal(error: BaseException) -> None:
        fatal.append(error)
        server.should_exit = True

    config.app = fastapi_app = create_app_from_settings(settings, on_fatal=on_fatal)
    typer.echo(f"artlike: serving {settings.served_model_name} on http://{network.host}:{network.port} "
               f"(data in {settings.data_dir}); the engine is starting, /health says when it is ready", err=True)
    server.run()
    return 1 if fatal else 0


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    app(args=argv)


if __name__ == "__main__":
    main()
