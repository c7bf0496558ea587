"""Which vLLM tool-call parser and chat template make tool calling work for a model, picked at start.

`artlike serve` turns tool calling on for every model it can: agent code sends `tools` unchanged, and vLLM
answers a request with tools only when it runs with a tool-call parser (and a template that renders
tools). The decision reads the model directory: `config.json` (`model_type`) and the chat template
(`chat_template.jinja`, or `chat_template` in `tokenizer_config.json`).

    the model's template                               parser        template
    ChatML (<|im_start|>) that renders tools           hermes        its own      Qwen2/2.5/3, Hermes...
    ChatML without tools                               hermes        tool-chatml  SmolLM2 (the default model)
    Llama 3 (<|start_header_id|>) that renders tools   llama3_json   its own      Llama 3.1 / 3.2 / 3.3
    Mistral ([INST]) that renders tools                mistral       its own
    anything else                                      (off)         its own      a startup message says how

`--tool-call-parser NAME` and `--chat-template FILE|tool-chatml` override the choice (either alone: the
other is still picked); `--tool-call-parser none` turns tool calling off. Pure: reads files, starts nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

OFF = "none"
"""`--tool-call-parser none`: no tool calling (requests with `tools` are then refused by vLLM)."""

HOW_TO_CHOOSE = ("pass --tool-call-parser NAME (one of vLLM's parsers, e.g. hermes, llama3_json, mistral, "
                 "pythonic) and, if the model's template does not render tools, --chat-template FILE")


@dataclass(frozen=True)
class ToolCalling:
    """The decision: `parser` None means tool calling is off; `chat_template` None means the model's own."""

    parser: str | None
    chat_template: str | None  # a built-in name ("tool-chatml") or a file path
    reason: str
    parallel_calls: bool = False  # whether the parser returns several calls from one answer


def model_chat_template(model_dir: Path) -> str | None:
    """The chat template a Hugging Face model directory ships, if any (the default one of a named set)."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    config = _json(model_dir / "tokenizer_config.json")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def renders_tools(template: str) -> bool:
    """Whether a Jinja chat template uses the `tools` variable (vLLM passes the request's tools as `tools`)."""
    return "tools" in template


def choose_tool_calling(model_dir: Path, *, parser: str | None = None, chat_template: str | None = None) -> ToolCalling:
    """The parser and template for `model_dir`; `parser` / `chat_template` are the user's overrides."""
    if parser == OFF:
        return ToolCalling(None, chat_template, "tool calling turned off (--tool-call-parser none)")
    own = model_chat_template(model_dir) if model_dir.is_dir() else None
    model_type = str(_json(model_dir / "config.json").get("model_type", "")) if model_dir.is_dir() else ""
    if parser is not None:
        return ToolCalling(parser, chat_template, f"--tool-call-parser {parser}", parser in _PARALLEL)
    if chat_template is not None:
        # A template of the user's: the parser follows its format (ours is Hermes-style ChatML).
        text = _template_text(chat_template)
        picked = _parser_for(text, model_type)
        if picked is None:
            return ToolCalling(None, chat_template, "the --chat-template's tool format is not one artlike knows; "
                               + HOW_TO_CHOOSE)
        return ToolCalling(picked, chat_template, f"--chat-template renders {picked}-style calls", picked in _PARALLEL)
    if own is None:
        return ToolCalling(None, None, "the model has no chat template; " + HOW_TO_CHOOSE)
    picked = _parser_for(own, model_type)
    if picked is None:
        return ToolCalling(None, None, f"model type {model_type or '?'} has a chat template whose tool format "
                           "artlike does not know; " + HOW_TO_CHOOSE)
    if renders_tools(own):
        return ToolCalling(picked, None, f"the model's own template renders tools ({picked})", picked in _PARALLEL)
    if picked == "hermes":
        return ToolCalling("hermes", "tool-chatml", "a ChatML template without tools: artlike's tool-chatml "
                           "(renders exactly like the model's own without tools) with the hermes parser", True)
    return ToolCalling(None, None, f"the model's {picked}-style template does not render tools; " + HOW_TO_CHOOSE)


_PARALLEL = frozenset({"hermes", "llama3_json", "mistral", "pythonic"})


def _parser_for(template: str, model_type: str) -> str | None:
    if "<|im_start|>" in template:
        return "hermes"
    if "<|start_header_id|>" in template:
        return "llama3_json"
    if "[INST]" in template or model_type in ("mistral", "mixtral"):
        return "mistral"
    return None


def _template_text(value: str) -> str:
    from artlike_server.engine.templates import resolve_chat_template

    path = Path(resolve_chat_template(value))
    return path.read_text() if path.is_file() else value


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
