"""The settings are the one source of every `serve` option: each field has a flag, a help text and the same
default on the command line as in the settings."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer.main
from artlike_server import cli
from artlike_server.cli_options import settings_flags
from artlike_server.settings import SECTIONS, ServerSettings
from typer.testing import CliRunner

# What `serve` resolves before the server starts, rather than passing the default on.
RESOLVED = {("engine", "device"), ("engine", "dtype"), ("engine", "dtype_source"), ("engine", "kv_cache_gib"),
            ("engine", "chat_template"), ("engine", "tool_call_parser"), ("trainer", "dtype"),
            ("trainer", "dtype_source"), ("limits", "reject_seed")}


def serve_options() -> dict[str, typer.core.TyperOption]:
    command = typer.main.get_command(cli.app).commands["serve"]  # type: ignore[attr-defined]
    return {param.name: param for param in command.params}


def test_every_settings_field_has_a_flag_with_help_and_the_settings_default() -> None:
    options = serve_options()
    flags = {(flag.section, flag.field): flag for flag in settings_flags()}
    for section, model in SECTIONS.items():
        for name, info in model.model_fields.items():
            assert info.description, f"{section}.{name} has no help"
            if (section, name) not in flags:  # resolved at start, never given
                assert (section, name) in RESOLVED, f"{section}.{name} has no flag"
                continue
            option = options[flags[section, name].param]
            assert option.help == info.description
            default = info.default
            assert option.default == (None if isinstance(default, tuple) else default), f"{section}.{name}"
    assert options["data_dir"].default == ServerSettings.model_fields["data_dir"].default


def test_a_server_started_without_options_runs_on_the_settings_defaults(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[ServerSettings] = []
    monkeypatch.setattr("artlike_server.cli.run", lambda settings, **_: seen.append(settings) or 0)
    result = CliRunner().invoke(cli.app, ["serve", "--model", str(tmp_path), "--data-dir", str(tmp_path / "d"),
                                          "--device", "cpu", "--dtype", "float32", "--trainer-dtype", "float32"],
                                env={"ARTLIKE_API_KEY": "", "ARTLIKE_ALLOWED_HOSTS": "", "ARTLIKE_ENGINE_KEY": "",
                                     "ARTLIKE_ENGINE_API_KEY": ""})
    assert result.exit_code == 0, result.output
    settings = seen[0]
    for section, model in SECTIONS.items():
        given = getattr(settings, section).model_dump()
        defaults = model().model_dump()
        for name in model.model_fields:
            if (section, name) not in RESOLVED:
                assert given[name] == defaults[name], f"{section}.{name}"


def test_help_texts_cite_no_timing_issue_or_design_section() -> None:
    for section, model in SECTIONS.items():
        for name, info in model.model_fields.items():
            text = info.description or ""
            assert not re.search(r"issue|#\d|DESIGN|§|\d(\.\d+)?x as|~\s?\d+(\.\d+)?\s?(s|ms|min)\b", text), \
                f"{section}.{name}: {text}"
