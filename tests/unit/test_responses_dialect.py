"""The Responses API translation (`openai_api/dialects/responses.py`): requests to chat bodies, chat answers
to responses and stream events, with worked examples; the store behind `previous_response_id`."""

from __future__ import annotations

import doctest
from pathlib import Path
from typing import Any

import orjson
import pytest
from artlike_server.errors import InvalidRequest, NotFound
from artlike_server.openai_api.dialects import responses
from artlike_server.openai_api.dialects.responses import ResponsesDialect, assistant_message, chat_body
from artlike_server.openai_api.response_store import ResponseStore


def test_doctests() -> None:
    assert doctest.testmod(responses, raise_on_error=True).attempted >= 1


def test_a_full_request_becomes_the_chat_body_it_means() -> None:
    body = {
        "model": "m", "instructions": "Be brief.", "max_output_tokens": 20, "temperature": 0.5, "top_p": 0.9,
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                             {"type": "input_text", "text": "b"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok",
                                                                  "annotations": []}], "id": "msg_1"},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{\"x\": 1}", "id": "fc_1"},
            {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "one"},
            {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
        ],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": False},
                  {"type": "function", "name": "g", "description": "G."}],
        "tool_choice": {"type": "function", "name": "f"}, "parallel_tool_calls": False,
        "include": ["message.output_text.logprobs"], "top_logprobs": 2,
        "text": {"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}, "strict": True}},
        "stream": True, "store": False, "metadata": {"k": "v"}, "reasoning": {"effort": "low"},
    }
    assert chat_body(body, []) == {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "ab"},
            {"role": "assistant", "content": "ok", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}},
                {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "one"},
            {"role": "tool", "tool_call_id": "c2", "content": "two"},
        ],
        "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": False}},
            {"type": "function", "function": {"name": "g", "description": "G.", "strict": True}},
        ],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "parallel_tool_calls": False,
        "max_tokens": 20, "temperature": 0.5, "top_p": 0.9,
        "response_format": {"type": "json_schema", "json_schema": {"name": "out", "schema": {"type": "object"},
                                                                   "strict": True}},
        "logprobs": True, "top_logprobs": 2,
        "stream": True, "stream_options": {"include_usage": True},
    }


def test_history_comes_before_the_new_input_and_instructions_first() -> None:
    history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    body = chat_body({"model": "m", "input": "next", "instructions": "I"}, history)
    assert body["messages"] == [{"role": "system", "content": "I"}, *history, {"role": "user", "content": "next"}]


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "x"}, "model"),
    ({"model": "m"}, "input"),
    ({"model": "m", "input": [{"role": "wizard", "content": "x"}]}, "input[0].role"),
    ({"model": "m", "input": [{"role": "user"}]}, "input[0].content"),
    ({"model": "m", "input": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "input[0].content[0].type"),
    ({"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
     "input[0].content[0].image_url"),
    ({"model": "m", "input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]},
     "input[0].arguments"),
    ({"model": "m", "input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"model": "m", "input": "x", "tools": [{"type": "file_search"}]}, "tools[0].type"),
    ({"model": "m", "input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "mcp"}},
     "tool_choice"),
    ({"model": "m", "input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"model": "m", "input": "x", "max_output_tokens": True}, "max_output_tokens"),
    ({"model": "m", "input": "x", "temperature": 3}, "temperature"),
    ({"model": "m", "input": "x", "text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ({"model": "m", "input": "x", "include": ["message.output_text.logprobs"], "top_logprobs": 21}, "top_logprobs"),
    ({"model": "m", "input": "x", "background": True}, "background"),
])
def test_bad_requests_name_the_parameter(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as bad:
        chat_body(body, [])
    assert bad.value.param == param and bad.value.status_code == 400


CHAT_ANSWER = {
    "id": "chatcmpl-1", "object": "chat.completion", "model": "m@2",
    "choices": [{"index": 0, "finish_reason": "tool_calls", "logprobs": None, "message": {
        "role": "assistant", "content": "Let me look.",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"x\":1}"}}]}}],
    "usage": {"prompt_tokens": 10, "completion_tokens": 7, "total_tokens": 17,
              "prompt_tokens_details": {"cached_tokens": 4}},
}


async def test_a_chat_answer_becomes_a_response_and_is_stored(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path / "responses.sqlite")
    dialect = ResponsesDialect(store)
    translation = await dialect.translate({"model": "m", "input": "hi", "instructions": "I", "metadata": {"k": "v"}})
    response = await translation.response(CHAT_ANSWER, "m@2")
    message, call = response["output"]
    assert message["type"] == "message" and message["content"] == [
        {"type": "output_text", "text": "Let me look.", "annotations": [], "logprobs": []}]
    assert {k: call[k] for k in ("type", "call_id", "name", "arguments", "status")} == {
        "type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{\"x\":1}", "status": "completed"}
    assert (response["status"], response["model"], response["metadata"], response["instructions"]) == (
        "completed", "m@2", {"k": "v"}, "I")
    assert response["usage"] == {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0},
                                 "output_tokens": 7, "output_tokens_details": {"reasoning_tokens": 0},
                                 "total_tokens": 17}
    # Stored without the instructions, with the answer as the assistant message that continues it.
    continued = await dialect.translate({"model": "m", "previous_response_id": response["id"],
                                         "input": [{"type": "function_call_output", "call_id": "call_1", "output": "1"}]})
    assert continued.chat_body["messages"] == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"x\":1}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "1"},
    ]
    assert await dialect.retrieve(response["id"]) == response
    assert (await dialect.delete(response["id"]))["deleted"] is True
    with pytest.raises(NotFound):
        await dialect.translate({"model": "m", "previous_response_id": response["id"], "input": "x"})
    store.close()


async def test_a_length_cut_answer_is_incomplete_and_store_false_is_not_kept(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path / "responses.sqlite")
    translation = await ResponsesDialect(store).translate({"model": "m", "input": "hi", "store": False})
    answer = {"choices": [{"index": 0, "finish_reason": "length", "message": {"role": "assistant", "content": "abc"}}]}
    response = await translation.response(answer, "m")
    assert (response["status"], response["incomplete_details"], response["store"]) == (
        "incomplete", {"reason": "max_output_tokens"}, False)
    assert await store.get(response["id"]) is None
    store.close()


def _events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for block in raw.decode().split("\n\n"):
        if block:
            kind, data = block.split("\n")
            events.append((kind.removeprefix("event: "), orjson.loads(data.removeprefix("data: "))))
    return events


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"id": "c", "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}


async def test_a_stream_of_text_then_a_tool_call_becomes_the_event_sequence(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path / "responses.sqlite")
    translation = await ResponsesDialect(store).translate({"model": "m", "input": "hi", "stream": True})
    encoder = translation.stream("m@1")
    raw = b"".join([
        encoder.chunk(_chunk({"role": "assistant", "content": "He"})),
        encoder.chunk(_chunk({"content": "llo"})),
        encoder.chunk(_chunk({"tool_calls": [{"index": 0, "id": "call_9", "type": "function",
                                              "function": {"name": "f", "arguments": ""}}]})),
        encoder.chunk(_chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{\"a\":"}}]})),
        encoder.chunk(_chunk({"tool_calls": [{"index": 0, "function": {"arguments": "2}"}}]}, "tool_calls")),
        encoder.chunk({"id": "c", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}}),
        await encoder.done(),
    ])
    events = _events(raw)
    assert [kind for kind, _ in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert all(kind == data["type"] for kind, data in events)
    final = events[-1][1]["response"]
    assert [item["type"] for item in final["output"]] == ["message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "Hello"
    assert (final["output"][1]["call_id"], final["output"][1]["arguments"]) == ("call_9", "{\"a\":2}")
    assert final["usage"]["total_tokens"] == 8 and final["model"] == "m@1"
    assert events[0][1]["response"]["status"] == "in_progress"
    assert (await store.get(final["id"])) is not None
    store.close()


def test_output_items_become_the_assistant_message_that_continues_them() -> None:
    assert assistant_message([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]) == {
        "role": "assistant", "content": None,
        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
