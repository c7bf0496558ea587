"""Tool calling on by default: the parser and template `artlike serve` picks from a model directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from artlike_server.engine.templates import builtin_chat_template
from artlike_server.engine.tool_calling import choose_tool_calling, model_chat_template

CHATML = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
QWEN = "{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}" + CHATML
LLAMA31 = ("{% if tools is not none %}Environment: ipython{% endif %}"
           "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>{{ m.content }}<|eot_id|>{% endfor %}")
LLAMA30 = "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>{{ m.content }}<|eot_id|>{% endfor %}"
MISTRAL = "{% if tools %}[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS]{% endif %}[INST] {{ messages[0].content }} [/INST]"
GEMMA = "{% for m in messages %}<start_of_turn>{{ m.role }}\n{{ m.content }}<end_of_turn>{% endfor %}"


def model_dir(tmp_path: Path, model_type: str, template: str | None, *, as_file: bool = False) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    tokenizer_config: dict[str, object] = {"eos_token": "<|im_end|>"}
    if template is not None and as_file:
        (tmp_path / "chat_template.jinja").write_text(template)
    elif template is not None:
        tokenizer_config["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return tmp_path


@pytest.mark.parametrize(("model_type", "template", "parser", "chosen_template"), [
    ("qwen2", QWEN, "hermes", None),  # Qwen2/2.5/3: their own template renders tools
    ("qwen3", QWEN, "hermes", None),
    ("llama", CHATML, "hermes", "tool-chatml"),  # SmolLM2: ChatML without tools
    ("llama", LLAMA31, "llama3_json", None),
    ("mistral", MISTRAL, "mistral", None),
])
def test_known_families_get_their_parser_and_a_template_that_renders_tools(
    tmp_path: Path, model_type: str, template: str, parser: str, chosen_template: str | None
) -> None:
    decision = choose_tool_calling(model_dir(tmp_path, model_type, template))
    assert (decision.parser, decision.chat_template) == (parser, chosen_template)
    assert decision.parallel_calls


@pytest.mark.parametrize(("model_type", "template"), [("gemma", GEMMA), ("llama", LLAMA30), ("gpt2", None)])
def test_an_unknown_family_is_off_with_a_message_saying_how_to_choose(
    tmp_path: Path, model_type: str, template: str | None
) -> None:
    decision = choose_tool_calling(model_dir(tmp_path, model_type, template))
    assert decision.parser is None and decision.chat_template is None
    assert "--tool-call-parser" in decision.reason and "--chat-template" in decision.reason


def test_overrides_win(tmp_path: Path) -> None:
    directory = model_dir(tmp_path, "gemma", GEMMA)
    assert choose_tool_calling(directory, parser="pythonic").parser == "pythonic"
    assert choose_tool_calling(model_dir(tmp_path, "qwen2", QWEN), parser="none").parser is None
    # A template of the user's picks the parser its format needs.
    assert (choose_tool_calling(directory, chat_template="tool-chatml").parser, "tool-chatml") == ("hermes", "tool-chatml")
    custom = tmp_path / "mine.jinja"
    custom.write_text(GEMMA)
    assert choose_tool_calling(directory, chat_template=str(custom)).parser is None


def test_the_template_is_read_from_its_file_or_from_a_named_set(tmp_path: Path) -> None:
    assert model_chat_template(model_dir(tmp_path / "a", "qwen2", QWEN, as_file=True)) == QWEN
    named = tmp_path / "b"
    named.mkdir()
    (named / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "x"}, {"name": "default", "template": QWEN}]}))
    assert model_chat_template(named) == QWEN


def test_the_builtin_tool_template_is_hermes_style_chatml() -> None:
    text = builtin_chat_template("tool-chatml").read_text()
    assert "<|im_start|>" in text and "<tool_call>" in text and "tools" in text
