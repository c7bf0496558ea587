"""The Anthropic Messages translation (`openai_api/dialects/anthropic_messages.py`): requests to chat bodies,
chat answers to messages and stream events, errors in Anthropic's shape; and the `x-api-key` header."""

from __future__ import annotations

import doctest
from typing import Any

import orjson
import pytest
from artlike_server.errors import InvalidRequest, NotFound, ServiceUnavailable
from artlike_server.openai_api.dialects import anthropic_messages
from artlike_server.openai_api.dialects.anthropic_messages import MessagesDialect, chat_body, error_body


def test_doctests() -> None:
    assert doctest.testmod(anthropic_messages, raise_on_error=True).attempted >= 2


def test_a_full_request_becomes_the_chat_body_it_means() -> None:
    body = {
        "model": "m", "max_tokens": 30, "system": [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}],
        "temperature": 0.5, "top_p": 0.9, "top_k": 20, "stop_sequences": ["END"], "stream": True,
        "metadata": {"user_id": "u"}, "thinking": {"type": "disabled"}, "output_config": {"effort": "low"},
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "look"},
                                         {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                      "data": "AAAA"}}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hm", "signature": "s"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"x": 1}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "2"}]},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "boom", "is_error": True},
                {"type": "text", "text": "and?", "cache_control": {"type": "ephemeral"}}]},
        ],
        "tools": [{"name": "f", "description": "F.", "input_schema": {"type": "object"}},
                  {"name": "g", "input_schema": {"type": "object"}, "strict": False}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
    }
    assert chat_body(body) == {
        "model": "m", "max_tokens": 30,
        "messages": [
            {"role": "system", "content": "Be\nbrief."},
            {"role": "user", "content": [{"type": "text", "text": "look"},
                                         {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "2"},
            {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: boom"},
            {"role": "user", "content": "and?"},
        ],
        "temperature": 0.5, "top_p": 0.9, "top_k": 20, "stop": ["END"],
        "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "description": "F.",
                                              "strict": True}},
            {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}, "strict": False}},
        ],
        "tool_choice": "required", "parallel_tool_calls": False,
        "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }


@pytest.mark.parametrize(("body", "field"), [
    ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"model": "m", "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}, "model"),
    ({"model": "m", "max_tokens": 5, "messages": []}, "messages"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user"}]}, "messages.0.content"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "document"}]}]},
     "messages.0.content.0.type"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": "{}"}]}]}, "messages.0.content.0.input"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "content": "x"}]}]}, "messages.0.content.0.tool_use_id"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools.0.type"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
      "tools": [{"name": "f"}]}, "tools.0.input_schema"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
      "tool_choice": {"type": "auto"}}, "tool_choice"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
      "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "temperature": 3}, "temperature"),
])
def test_bad_requests_name_the_field(body: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequest) as bad:
        chat_body(body)
    assert bad.value.param == field


async def test_a_chat_answer_becomes_a_message() -> None:
    translation = await MessagesDialect().translate({"model": "m", "max_tokens": 9, "stop_sequences": ["END"],
                                                     "messages": [{"role": "user", "content": "hi"}]})
    answer = {"choices": [{"index": 0, "finish_reason": "stop", "stop_reason": "END", "message": {
        "role": "assistant", "content": "Sure.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": [1]}"}},
            {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "not json"}}]}}],
              "usage": {"prompt_tokens": 7, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 4}}}
    message = await translation.response(answer, "m@1")
    assert message["content"] == [{"type": "text", "text": "Sure."},
                                  {"type": "tool_use", "id": "call_1", "name": "f", "input": {"a": [1]}},
                                  {"type": "text", "text": "not json"}]
    assert (message["stop_reason"], message["stop_sequence"], message["model"]) == ("tool_use", None, "m@1")
    assert message["usage"] == {"input_tokens": 7, "output_tokens": 3, "cache_creation_input_tokens": 0,
                                "cache_read_input_tokens": 4}
    plain = {"choices": [{"index": 0, "finish_reason": "stop", "stop_reason": "END",
                          "message": {"role": "assistant", "content": "x"}}]}
    assert (await translation.response(plain, "m"))["stop_reason"] == "stop_sequence"


def _events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in raw.decode().split("\n\n"):
        if block:
            kind, data = block.split("\n")
            out.append((kind.removeprefix("event: "), orjson.loads(data.removeprefix("data: "))))
    return out


def _chunk(delta: dict[str, Any], finish: str | None = None, usage: dict[str, int] | None = None) -> dict[str, Any]:
    chunk: dict[str, Any] = {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage is not None:
        chunk["usage"] = usage
    return chunk


async def test_a_stream_of_text_then_a_tool_call_becomes_anthropics_events() -> None:
    translation = await MessagesDialect().translate({"model": "m", "max_tokens": 9, "stream": True,
                                                     "messages": [{"role": "user", "content": "hi"}]})
    encoder = translation.stream("m@2")
    usage = {"prompt_tokens": 5, "completion_tokens": 0}
    raw = b"".join([
        encoder.chunk(_chunk({"role": "assistant", "content": ""}, usage=usage)),
        encoder.chunk(_chunk({"content": "Hi"}, usage={**usage, "completion_tokens": 1})),
        encoder.chunk(_chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                              "function": {"name": "f", "arguments": "{\"a\""}}]})),
        encoder.chunk(_chunk({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}, "tool_calls")),
        encoder.chunk({"choices": [], "usage": {**usage, "completion_tokens": 6}}),
        await encoder.done(),
    ])
    events = _events(raw)
    assert [kind for kind, _ in events] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop"]
    assert all(kind == data["type"] for kind, data in events)
    start = events[0][1]["message"]
    assert (start["model"], start["usage"]["input_tokens"], start["usage"]["output_tokens"]) == ("m@2", 5, 0)
    assert events[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert events[2][1]["delta"] == {"type": "text_delta", "text": "Hi"}
    assert events[4][1]["content_block"] == {"type": "tool_use", "id": "call_1", "name": "f", "input": {}}
    assert "".join(d["delta"]["partial_json"] for k, d in events[5:7]) == "{\"a\": 1}"
    assert [d["index"] for k, d in events[4:8]] == [1, 1, 1, 1]
    assert events[8][1] == {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                            "usage": {"output_tokens": 6}}


def test_errors_are_anthropic_shaped() -> None:
    assert error_body(InvalidRequest("bad", param="x")) == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "bad"}}
    assert error_body(NotFound("no model"))["error"]["type"] == "not_found_error"
    assert error_body(ServiceUnavailable("busy"))["error"]["type"] == "overloaded_error"
