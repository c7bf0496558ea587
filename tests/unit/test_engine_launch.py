"""The vLLM launch: command line, environment, device detection, ports, built-in chat templates."""

from __future__ import annotations

import importlib.metadata
import os
import socket
from dataclasses import replace
from pathlib import Path

import pytest
from artlike_server.engine.launch import (
    CPU_BLOCK_SIZE,
    EngineConfig,
    build_command,
    build_env,
    detect_device,
    format_cpu_list,
    free_port,
    parse_cpu_list,
)
from artlike_server.engine.templates import TEMPLATES_DIR, builtin_chat_template, resolve_chat_template

CONFIG = EngineConfig(
    model_path=Path("/models/smol"),
    served_model_name="HuggingFaceTB/SmolLM2-135M-Instruct",
    port=18123,
    log_path=Path("/tmp/engine.log"),
)
KEY = "per-start-engine-key"


def flag_value(command: list[str], flag: str) -> str:
    assert command.count(flag) == 1, f"{flag} appears {command.count(flag)} times in {command}"
    return command[command.index(flag) + 1]


def test_command_runs_vllms_openai_server_with_the_given_python() -> None:
    command = build_command(CONFIG, python="/venv/bin/python")
    assert command[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert flag_value(command, "--model") == "/models/smol"
    assert flag_value(command, "--served-model-name") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert flag_value(command, "--host") == "127.0.0.1"
    assert flag_value(command, "--port") == "18123"
    assert flag_value(command, "--dtype") == "auto"


def test_command_turns_on_runtime_lora_and_prefix_caching() -> None:
    command = build_command(replace(CONFIG, max_lora_rank=32, max_loras=6))
    assert "--enable-lora" in command
    assert flag_value(command, "--max-lora-rank") == "32"
    assert flag_value(command, "--max-loras") == "6"
    assert "--enable-prefix-caching" in command


def test_cpu_uses_32_token_blocks_and_no_chunked_prefill() -> None:
    command = build_command(CONFIG)
    assert flag_value(command, "--block-size") == str(CPU_BLOCK_SIZE) == "32"
    # A per-request seed crashes vLLM-CPU when a prefill is split across steps (see build_command).
    assert "--no-enable-chunked-prefill" in command


def test_cuda_keeps_vllms_block_size_and_chunked_prefill_unless_asked() -> None:
    cuda = replace(CONFIG, device="cuda")
    assert "--block-size" not in build_command(cuda)
    assert "--no-enable-chunked-prefill" not in build_command(cuda)
    assert flag_value(build_command(replace(cuda, block_size=64)), "--block-size") == "64"


def test_kv_cache_size_is_passed_in_bytes_and_can_be_left_to_vllm() -> None:
    assert flag_value(build_command(replace(CONFIG, kv_cache_gib=1.5)), "--kv-cache-memory-bytes") == str(
        3 * 2**29
    )
    assert "--kv-cache-memory-bytes" not in build_command(replace(CONFIG, kv_cache_gib=None))


def test_max_model_len_is_optional() -> None:
    assert flag_value(build_command(CONFIG), "--max-model-len") == "4096"
    assert "--max-model-len" not in build_command(replace(CONFIG, max_model_len=None))


def test_tool_call_parser_enables_auto_tool_choice() -> None:
    assert "--enable-auto-tool-choice" not in build_command(CONFIG)
    command = build_command(replace(CONFIG, tool_call_parser="hermes"))
    assert flag_value(command, "--tool-call-parser") == "hermes"
    assert "--enable-auto-tool-choice" in command


def test_chat_template_accepts_a_builtin_name_or_a_path() -> None:
    by_name = build_command(replace(CONFIG, chat_template="tool-chatml"))
    assert flag_value(by_name, "--chat-template") == str(TEMPLATES_DIR / "chatml_tools.jinja")
    by_path = build_command(replace(CONFIG, chat_template="/my/template.jinja"))
    assert flag_value(by_path, "--chat-template") == "/my/template.jinja"
    assert "--chat-template" not in build_command(CONFIG)


def test_extra_args_come_last_so_they_override() -> None:
    command = build_command(replace(CONFIG, extra_args=("--max-num-seqs", "32", "--enable-chunked-prefill")))
    assert command[-3:] == ["--max-num-seqs", "32", "--enable-chunked-prefill"]


def test_env_turns_on_runtime_lora_and_binds_threads_on_cpu() -> None:
    base = {"PATH": "/usr/bin", "VLLM_CPU_KVCACHE_SPACE": "8"}
    env = build_env(CONFIG, base, api_key=KEY, cpu_ids=[0, 1])
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # the engine core runs the model: no worker process
    assert env["PATH"] == "/usr/bin"
    # vLLM-CPU would let this legacy variable override --kv-cache-memory-bytes.
    assert "VLLM_CPU_KVCACHE_SPACE" not in env
    assert base == {"PATH": "/usr/bin", "VLLM_CPU_KVCACHE_SPACE": "8"}, "base_env must not be mutated"


def test_the_engine_runs_without_dev_mode_and_with_the_key_in_its_environment_only() -> None:
    # Dev mode opens /collective_rpc, /sleep and weight updates; an inherited setting is dropped too.
    env = build_env(CONFIG, {"VLLM_SERVER_DEV_MODE": "1"}, api_key=KEY, cpu_ids=[0])
    assert "VLLM_SERVER_DEV_MODE" not in env
    assert env["VLLM_API_KEY"] == KEY
    command = build_command(CONFIG)
    # Not on the command line: any local user can read /proc/PID/cmdline (and engine.log logs it).
    assert KEY not in " ".join(command) and "--api-key" not in command
    # vLLM's own guard covers only /v1...; this one covers every route but /health.
    assert flag_value(command, "--middleware") == "artlike_server.engine.engine_auth.EngineKeyMiddleware"


def test_env_keeps_an_operators_thread_binding_and_applies_extra_env_last() -> None:
    config = replace(CONFIG, extra_env=(("VLLM_SERVER_DEV_MODE", "1"), ("ARTLIKE_X", "1")))
    env = build_env(config, {"VLLM_CPU_OMP_THREADS_BIND": "2-3", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
                    api_key=KEY, cpu_ids=[0, 1])
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "2-3"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["ARTLIKE_X"] == "1"


def test_env_on_cuda_sets_no_cpu_variables() -> None:
    env = build_env(replace(CONFIG, device="cuda"), {}, api_key=KEY, cpu_ids=[0, 1])
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env and "VLLM_ENABLE_V1_MULTIPROCESSING" not in env


def test_env_defaults_to_this_process_cpu_affinity() -> None:
    expected = format_cpu_list(os.sched_getaffinity(0))
    assert build_env(CONFIG, {}, api_key=KEY)["VLLM_CPU_OMP_THREADS_BIND"] == expected


@pytest.mark.parametrize(
    ("ids", "expected"),
    [([0], "0"), ([0, 1], "0-1"), ([3, 0, 1, 2], "0-3"), ([0, 1, 2, 5, 7, 8], "0-2,5,7-8"), ([4, 6], "4,6")],
)
def test_format_cpu_list(ids: list[int], expected: str) -> None:
    assert format_cpu_list(ids) == expected


def test_format_cpu_list_rejects_nothing() -> None:
    with pytest.raises(ValueError):
        format_cpu_list([])


@pytest.mark.parametrize("text", ["0", "0-1", "0-3", "0-2,5,7-8", "4,6"])
def test_parse_cpu_list_inverts_format(text: str) -> None:
    assert format_cpu_list(parse_cpu_list(text)) == text


@pytest.mark.parametrize("text", ["", "a", "1-", "3-1", "0,,1", "-1"])
def test_parse_cpu_list_rejects_what_is_not_a_list(text: str) -> None:
    with pytest.raises(ValueError, match="not a CPU list"):
        parse_cpu_list(text)


def test_env_binds_the_engine_to_its_configured_cores() -> None:
    assert build_env(replace(CONFIG, cpu_ids=(0,)), {}, api_key=KEY)["VLLM_CPU_OMP_THREADS_BIND"] == "0"


def test_detect_device_override() -> None:
    assert detect_device({"ARTLIKE_DEVICE": "cuda"}) == "cuda"
    assert detect_device({"ARTLIKE_DEVICE": "cpu"}) == "cpu"
    with pytest.raises(ValueError, match="ARTLIKE_DEVICE"):
        detect_device({"ARTLIKE_DEVICE": "tpu"})


def test_detect_device_picks_cpu_where_the_vllm_cpu_build_is_installed() -> None:
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed here")
    assert detect_device({}) == "cpu"


def test_free_port_is_bindable() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_base_url() -> None:
    assert CONFIG.base_url == "http://127.0.0.1:18123"


def test_builtin_chat_template() -> None:
    path = builtin_chat_template("tool-chatml")
    assert path.is_file() and path.suffix == ".jinja"
    assert resolve_chat_template("tool-chatml") == str(path)
    assert resolve_chat_template("{{ messages }}") == "{{ messages }}"
    with pytest.raises(KeyError, match="tool-chatml"):
        builtin_chat_template("nope")


def test_a_policy_engine_runs_without_lora_in_dev_mode_with_the_merge_backend() -> None:
    # Its weights follow the training policy through vLLM's weight-update routes (dev mode, behind the key).
    config = replace(CONFIG, policy=True)
    command = build_command(config)
    assert "--enable-lora" not in command and "--max-loras" not in command
    assert flag_value(command, "--weight-transfer-config") == '{"backend":"artlike_merge"}'
    assert flag_value(command, "--middleware") == "artlike_server.engine.engine_auth.EngineKeyMiddleware"
    assert build_env(config, {}, api_key=KEY, cpu_ids=[0])["VLLM_SERVER_DEV_MODE"] == "1"
