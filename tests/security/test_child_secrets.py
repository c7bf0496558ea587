"""The server's secrets stay out of its children and off command lines: the engine, the trainer worker and
whatever else `artlike serve` starts get environments without `ARTLIKE_API_KEY` (or the key's value under any
name), and the key can come from a file or the environment instead of argv (`launcher.py` uses the
environment), since every local user can read `/proc/*/cmdline`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import psutil
import pytest
from artlike_server.child_env import drop_secrets, without_secrets
from artlike_server.cli import app as cli_app
from artlike_server.engine.launch import EngineConfig, build_env
from artlike_server.launcher import ServerProcess
from artlike_server.settings import ServerSettings
from artlike_server.training.trainer_client import TrainerProcess
from typer.testing import CliRunner

SECRET = "the-server-api-key-123"
INHERITED = {"PATH": "/usr/bin:/bin", "HOME": "/home/u", "ARTLIKE_API_KEY": SECRET, "ARTLIKE_ENGINE_KEY": "rk",
             "ARTLIKE_ENGINE_API_KEY": "ek", "MY_COPY": SECRET, "MY_URL": f"http://u:{SECRET}@h/", "SHORT": "ab"}


def test_secret_variables_and_values_are_left_out() -> None:
    assert without_secrets(INHERITED, [SECRET, "ab"]) == {"PATH": "/usr/bin:/bin", "HOME": "/home/u"}
    environ = dict(INHERITED)
    assert drop_secrets(environ, [SECRET]) == ["ARTLIKE_API_KEY", "ARTLIKE_ENGINE_API_KEY", "ARTLIKE_ENGINE_KEY",
                                               "MY_COPY", "MY_URL"]
    # A short secret is matched as a whole value only: it must not take PATH with it.
    assert without_secrets({"PATH": "/usr/bin", "X": "b"}, ["b"]) == {"PATH": "/usr/bin"}


def test_the_engines_environment_has_its_own_key_and_not_the_servers(tmp_path: Path) -> None:
    config = EngineConfig(model_path=tmp_path, served_model_name="m", port=1, log_path=tmp_path / "engine.log")
    env = build_env(config, INHERITED, api_key="engine-key", cpu_ids=[0])
    assert env["VLLM_API_KEY"] == "engine-key"
    assert not {"ARTLIKE_API_KEY", "ARTLIKE_ENGINE_KEY", "ARTLIKE_ENGINE_API_KEY"} & set(env)


async def test_the_trainer_worker_starts_without_the_servers_key(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in worker (a real process launched the way the trainer is) reports the environment it got."""
    seen = tmp_path / "environ.json"
    worker = tmp_path / "worker"
    worker.write_text(f"#!{sys.executable}\nimport json, os\n"
                      f"open({str(seen)!r}, 'w').write(json.dumps(dict(os.environ)))\n"
                      "print(json.dumps({'event': 'ready', 'id': 0, 'device': 'cpu', 'dtype': 'float32', "
                      "'threads': 1, 'backend': 'peft', 'vocab_size': 10, 'load_seconds': 0.0}), flush=True)\n")
    worker.chmod(0o755)
    monkeypatch.setenv("ARTLIKE_API_KEY", SECRET)
    process = TrainerProcess(tmp_path / "model", python=str(worker), start_timeout=30.0, command_timeout=5.0)
    try:
        await process.start()
    finally:
        await process.stop()
    env = json.loads(seen.read_text())
    assert "ARTLIKE_API_KEY" not in env and SECRET not in json.dumps(env)
    assert env["PATH"] == os.environ["PATH"]  # the rest is inherited


def serve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *args: str,
          env: dict[str, str] | None = None) -> tuple[int, str, list[tuple[ServerSettings, dict[str, str]]]]:
    """`artlike serve ARGS` up to the point it would start serving: the settings and the environment then."""
    seen: list[tuple[ServerSettings, dict[str, str]]] = []
    monkeypatch.setattr("artlike_server.cli.run", lambda settings, **_: seen.append((settings, dict(os.environ))) or 0)
    result = CliRunner().invoke(cli_app, ["serve", "--model", str(tmp_path), "--device", "cpu", "--dtype", "float32",
                                          "--trainer-dtype", "float32", "--data-dir", str(tmp_path / "data"), *args],
                                env={"ARTLIKE_API_KEY": "", **(env or {})})
    # rich boxes and wraps error messages: compare words only
    return result.exit_code, " ".join(result.output.replace("│", " ").split()), seen


def test_the_api_key_is_read_from_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key_file = tmp_path / "api-key"
    key_file.write_text(f"{SECRET}\n")
    key_file.chmod(0o600)
    code, output, seen = serve(tmp_path, monkeypatch, "--api-key-file", str(key_file))
    assert code == 0, output
    assert seen[0][0].network.api_key == SECRET and "readable by other users" not in output
    key_file.chmod(0o644)
    code, output, _ = serve(tmp_path, monkeypatch, "--api-key-file", str(key_file))
    assert code == 0 and "readable by other users: chmod 600" in output
    for args, env, message in (
        (["--api-key-file", str(key_file), "--api-key", "x"], {}, "not both"),
        (["--api-key-file", str(key_file)], {"ARTLIKE_API_KEY": "x"}, "not both"),
        (["--api-key-file", str(tmp_path / "missing")], {}, "cannot read"),
    ):
        code, output, _ = serve(tmp_path, monkeypatch, *args, env=env)
        assert code == 2 and message in output and "--api-key-file" in output, output
    key_file.write_text("\n")
    code, output, _ = serve(tmp_path, monkeypatch, "--api-key-file", str(key_file))
    assert code == 2 and "is empty" in output


def test_engine_keys_from_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = tmp_path / "engine-keys"
    keys.write_text("k1\nk2\n")
    keys.chmod(0o600)
    urls = ["--engine-url", "http://127.0.0.1:9001", "--engine-url", "http://127.0.0.1:9002"]
    code, output, seen = serve(tmp_path, monkeypatch, *urls, "--engine-key-file", str(keys))
    assert code == 0, output
    assert seen[0][0].scale_out.engine_keys == ("k1", "k2")


def test_serve_drops_the_secrets_from_what_its_children_inherit(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    code, output, seen = serve(tmp_path, monkeypatch, env={"ARTLIKE_API_KEY": SECRET, "ARTLIKE_ENGINE_KEY": "rk",
                                                           "OPENAI_API_KEY": SECRET})
    assert code == 0, output
    settings, environ = seen[0]
    assert settings.network.api_key == SECRET
    assert not {"ARTLIKE_API_KEY", "ARTLIKE_ENGINE_KEY", "OPENAI_API_KEY"} & set(environ)


@pytest.mark.integration
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_real_servers_children_hold_no_copy_of_its_key(server: ServerProcess) -> None:
    key = server.api_key.encode()
    assert key not in Path(f"/proc/{server.process.pid}/cmdline").read_bytes(), "the launcher uses the environment"
    commands = []
    for child in psutil.Process(server.process.pid).children(recursive=True):
        try:
            cmdline = Path(f"/proc/{child.pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{child.pid}/environ").read_bytes()
        except (FileNotFoundError, ProcessLookupError):
            continue  # exited meanwhile (the dtype probe, a sandbox worker)
        commands.append(cmdline)
        assert key not in cmdline, cmdline
        assert b"ARTLIKE_API_KEY=" not in environ and key not in environ, cmdline
    assert any(b"vllm" in c for c in commands), f"the engine is among the server's children: {commands}"
    assert any(b"torch_worker.worker" in c for c in commands), f"so is the trainer: {commands}"
