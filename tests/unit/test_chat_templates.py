"""The built-in `tool-chatml` template, rendered the way vLLM renders it (transformers' chat templating)."""

from __future__ import annotations

from typing import Any

import pytest
from artlike_server.engine.templates import builtin_chat_template

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from artlike_server.default_model import DefaultModelUnavailable, ensure_default_model

    try:
        model_dir = ensure_default_model()
    except DefaultModelUnavailable as error:
        pytest.skip(str(error))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def template() -> str:
    return builtin_chat_template("tool-chatml").read_text()


def render(tokenizer: Any, messages: list[dict[str, Any]], template: str | None = None, **kwargs: Any) -> str:
    rendered: str = tokenizer.apply_chat_template(messages, tokenize=False, chat_template=template, **kwargs)
    return rendered


CONVERSATIONS_WITHOUT_TOOLS = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "2+2?"},
    ],
    [{"role": "user", "content": "a\nb"}, {"role": "assistant", "content": " spaced "}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS_WITHOUT_TOOLS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_without_tools_it_renders_exactly_like_smollm2s_own_template(
    tokenizer: Any, template: str, messages: list[dict[str, Any]], add_generation_prompt: bool
) -> None:
    own = render(tokenizer, messages, add_generation_prompt=add_generation_prompt)
    assert own.startswith("<|im_start|>system\n")
    assert render(tokenizer, messages, template, add_generation_prompt=add_generation_prompt) == own


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOLS_BLOCK = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}\n'
    "</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def test_a_tool_conversation_worked_example(tokenizer: Any, template: str) -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris and Lyon?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                # vLLM hands arguments over as a dict; a JSON string (transformers' callers) works too.
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                },
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "18C"},
        {"role": "tool", "tool_call_id": "c2", "content": "20C"},
        {"role": "assistant", "content": "Paris 18C, Lyon 20C."},
    ]
    expected = (
        f"<|im_start|>system\n{DEFAULT_SYSTEM}\n\n{TOOLS_BLOCK}<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris and Lyon?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\n20C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nParis 18C, Lyon 20C.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert render(tokenizer, messages, template, tools=[WEATHER_TOOL], add_generation_prompt=True) == expected


def test_a_users_system_prompt_comes_before_the_tools(tokenizer: Any, template: str) -> None:
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    rendered = render(tokenizer, messages, template, tools=[WEATHER_TOOL], add_generation_prompt=False)
    assert (
        rendered
        == f"<|im_start|>system\nBe terse.\n\n{TOOLS_BLOCK}<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    )


def test_tool_calls_in_history_render_even_when_no_tools_are_offered(tokenizer: Any, template: str) -> None:
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
        {"role": "tool", "content": "ok"},
    ]
    assert render(tokenizer, messages, template) == (
        f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\nWeather?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nok\n</tool_response><|im_end|>\n"
    )
