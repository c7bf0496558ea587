"""Anthropic's Messages API (`/v1/messages`) against the real server through the official `anthropic` SDK:
translated to chat completions (see `openai_api/dialects`), recorded token-exact, trainable; and the
translation checked against vLLM's own `/v1/messages`. Uses the session fixture `server` (tests/conftest.py)."""

from __future__ import annotations

from typing import Any
from uuid import uuid4

import anthropic
import httpx
import pytest
from artlike_server.launcher import ServerProcess

import artlike as art

from .engine_helpers import engine_connection
from .helpers import anthropic_client, openai_client, recorded, trainable_model

pytestmark = pytest.mark.integration

QUESTION = "What is the capital of France? Answer in one word."
GREEDY = {"temperature": 0}  # sampling parameters are not in the anthropic SDK's signature any more: extra_body
WEATHER_TOOL: dict[str, Any] = {
    "name": "get_weather", "description": "The current weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def test_a_message_is_a_recorded_chat_completion_with_the_same_tokens(server: ServerProcess) -> None:
    trajectory = uuid4().hex
    message = anthropic_client(server, trajectory).messages.create(
        model=server.model_id, max_tokens=12, extra_body=GREEDY, system="You are terse.",
        messages=[{"role": "user", "content": QUESTION}])
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    [block] = message.content
    assert block.type == "text" and message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.output_tokens > 0 and message.usage.input_tokens > 0

    chat_trajectory = uuid4().hex
    chat = openai_client(server, chat_trajectory, max_retries=2).chat.completions.create(
        model=server.model_id, max_tokens=12, extra_body=GREEDY,
        messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": QUESTION}])
    assert chat.choices[0].message.content == block.text
    [row] = recorded(server, trajectory)
    [chat_row] = recorded(server, chat_trajectory)
    assert row["endpoint"] == "messages" and row["request"]["system"] == "You are terse."
    assert (row["prompt_token_ids"], row["output_token_ids"]) == (chat_row["prompt_token_ids"], chat_row["output_token_ids"])
    assert len(row["logprobs"]) == len(row["output_token_ids"]) == message.usage.output_tokens


def test_streams_build_the_same_message(server: ServerProcess) -> None:
    client = anthropic_client(server, uuid4().hex)
    whole = client.messages.create(model=server.model_id, max_tokens=12, extra_body=GREEDY,
                                   messages=[{"role": "user", "content": QUESTION}])
    with client.messages.stream(model=server.model_id, max_tokens=12, extra_body=GREEDY,
                                messages=[{"role": "user", "content": QUESTION}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole.content[0].text  # type: ignore[union-attr]
    assert (final.usage.input_tokens, final.usage.output_tokens) == (whole.usage.input_tokens, whole.usage.output_tokens)
    raw = client.messages.create(model=server.model_id, max_tokens=4, extra_body=GREEDY, stream=True,
                                 messages=[{"role": "user", "content": QUESTION}])
    kinds = [event.type for event in raw]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert "content_block_delta" in kinds


def test_a_forced_tool_call_and_its_result_continue_the_conversation(capable_server: ServerProcess) -> None:
    server = capable_server  # a call whose arguments the model completes: the full model
    trajectory = uuid4().hex
    client = anthropic_client(server, trajectory)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.messages.create(model=server.model_id, max_tokens=48, extra_body=GREEDY, messages=messages,  # type: ignore[arg-type]
                                   tools=[WEATHER_TOOL], tool_choice={"type": "tool", "name": "get_weather"})  # type: ignore[list-item]
    [call] = [block for block in first.content if block.type == "tool_use"]
    assert call.name == "get_weather" and isinstance(call.input, dict) and first.stop_reason == "tool_use"
    messages += [{"role": "assistant", "content": [block.model_dump() for block in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny"}]}]
    with client.messages.stream(model=server.model_id, max_tokens=24, extra_body=GREEDY, messages=messages,  # type: ignore[arg-type]
                                tools=[WEATHER_TOOL]) as stream:  # type: ignore[list-item]
        second = stream.get_final_message()
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    rows = recorded(server, trajectory)
    assert [row["endpoint"] for row in rows] == ["messages", "messages"]
    # The second prompt holds the first call and its result after the first prompt.
    assert rows[1]["prompt_token_ids"][: len(rows[0]["prompt_token_ids"])] == rows[0]["prompt_token_ids"]


def test_bad_requests_are_anthropic_errors_naming_the_field(server: ServerProcess) -> None:
    client = anthropic_client(server, uuid4().hex)
    cases = [
        ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        ({"max_tokens": 5, "messages": [{"role": "system", "content": "hi"}]}, "messages.0.role"),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
         "messages.0.content.0.type"),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
          "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ]
    for extra, field in cases:
        response = httpx.post(f"{server.base_url}/v1/messages", json={"model": server.model_id, **extra},
                              headers={"x-api-key": server.api_key, "anthropic-version": "2023-06-01"})
        assert response.status_code == 400, (extra, response.text)
        body = response.json()
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert body["error"]["message"].startswith(field), (field, body)
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=server.model_id, max_tokens=5, messages=[{"role": "robot", "content": "x"}])  # type: ignore[typeddict-item]
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0).messages.create(
            model=server.model_id, max_tokens=5, messages=[{"role": "user", "content": "hi"}])


def test_the_translation_matches_vllms_own_messages_route(server: ServerProcess) -> None:
    engine = engine_connection(server)
    body = {"model": server.model_id, "max_tokens": 12, "temperature": 0, "system": "You are terse.",
            "messages": [{"role": "user", "content": QUESTION}]}
    direct = httpx.post(f"{engine.base_url}/v1/messages", json=body, headers=engine.headers, timeout=60)
    direct.raise_for_status()
    ours = anthropic_client(server).messages.create(**{k: v for k, v in body.items() if k != "temperature"},  # type: ignore[arg-type]
                                              extra_body=GREEDY)
    theirs = direct.json()
    assert ours.content[0].text == "".join(b["text"] for b in theirs["content"] if b["type"] == "text")  # type: ignore[union-attr]
    assert (ours.usage.input_tokens, ours.usage.output_tokens) == (
        theirs["usage"]["input_tokens"], theirs["usage"]["output_tokens"])
    assert ours.stop_reason == theirs["stop_reason"]


async def test_a_trajectory_recorded_through_the_anthropic_sdk_trains_a_step(capable_server: ServerProcess) -> None:
    server = capable_server  # calls whose arguments the model completes: the full model
    from examples.integrations.anthropic_sdk import run_weather_turns

    model = trainable_model(server, f"claude-like-{uuid4().hex[:8]}")
    await model.register()
    trajectories = []
    for reward in (1.0, 0.0):
        async with model.trajectory() as t:
            # Greedy: the forced call always completes (sampled, its arguments can run past max_tokens).
            answer = await run_weather_turns(t.base_url.removesuffix("/v1"), server.api_key, model.name,
                                             temperature=0.0)
            t.reward = reward + (0.5 if "sunny" in answer.lower() else 0.0)
        assert t.exception is None, t.exception
        record = await t.get_record()
        assert len(record.completions) == 2 and {c.endpoint for c in record.completions} == {"messages"}
        trajectories.append(t)
    result = await model.train([art.TrajectoryGroup(trajectories)], learning_rate=1e-5, progress=False)
    assert result.trained and result.step == 1
