"""The Responses API (`/v1/responses`) against the real server, through the official `openai` SDK and the
OpenAI Agents SDK: translated to chat completions (see `openai_api/dialects`), recorded token-exact,
trainable; and the translation checked against vLLM's own `/v1/responses` route.

Uses the session fixture `server` (tests/conftest.py)."""

from __future__ import annotations

import asyncio
from typing import Literal
from uuid import uuid4

import httpx
import openai
import pytest
from artlike_server.launcher import ServerProcess

import artlike as art

from .engine_helpers import engine_connection
from .helpers import openai_client, recorded, trainable_model

pytestmark = pytest.mark.integration

WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
QUESTION = "What is the capital of France? Answer in one word."


def test_a_response_is_a_recorded_chat_completion_with_the_same_tokens(server: ServerProcess) -> None:
    trajectory = uuid4().hex
    response = openai_client(server, trajectory).responses.create(
        model=server.model_id, input=QUESTION, instructions="You are terse.", temperature=0, max_output_tokens=12)
    assert response.status in ("completed", "incomplete") and response.id.startswith("resp_")
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert response.output_text == message.content[0].text
    assert response.usage is not None and response.usage.output_tokens > 0

    # The same conversation through chat completions gives the same tokens; the row names its route.
    chat_trajectory = uuid4().hex
    chat = openai_client(server, chat_trajectory).chat.completions.create(
        model=server.model_id, temperature=0, max_tokens=12,
        messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": QUESTION}])
    assert chat.choices[0].message.content == response.output_text
    [row] = recorded(server, trajectory)
    [chat_row] = recorded(server, chat_trajectory)
    assert row["endpoint"] == "responses" and chat_row["endpoint"] == "chat.completions"
    assert row["request"]["input"] == QUESTION  # the caller's body, as sent
    assert (row["prompt_token_ids"], row["output_token_ids"]) == (chat_row["prompt_token_ids"], chat_row["output_token_ids"])
    assert len(row["logprobs"]) == len(row["output_token_ids"]) == response.usage.output_tokens


def test_streamed_events_build_the_same_response(capable_server: ServerProcess) -> None:
    # The SDK builds a final response only from a completed one: a model that stops within max_output_tokens.
    server = capable_server
    client = openai_client(server, uuid4().hex)
    whole = client.responses.create(model=server.model_id, input=QUESTION, temperature=0, max_output_tokens=12)
    with client.responses.stream(model=server.model_id, input=QUESTION, temperature=0, max_output_tokens=12) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert "response.output_text.delta" in kinds and kinds.index("response.output_item.added") < kinds.index(
        "response.output_text.delta") < kinds.index("response.output_text.done") < kinds.index("response.output_item.done")
    assert final.output_text == whole.output_text
    assert final.usage is not None and whole.usage is not None
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_function_tools_and_previous_response_id(capable_server: ServerProcess) -> None:
    server = capable_server  # a call whose arguments the model completes: the full model
    trajectory = uuid4().hex
    client = openai_client(server, trajectory)
    first = client.responses.create(
        model=server.model_id, input="What is the weather in Paris?", tools=[WEATHER_TOOL],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"}, temperature=0, max_output_tokens=48)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id
    # The tool's answer continues the stored conversation, streamed this time.
    with client.responses.stream(
        model=server.model_id, previous_response_id=first.id, tools=[WEATHER_TOOL],  # type: ignore[list-item]
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 C"}],
        temperature=0, max_output_tokens=24,
    ) as stream:
        kinds = [event.type for event in stream]
        second = stream.get_final_response()
    assert kinds[-1] in ("response.completed", "response.incomplete") and second.previous_response_id == first.id
    assert client.responses.retrieve(second.id).id == second.id

    # Both turns are recorded; the second prompt holds the first turn's call and the tool's answer.
    rows = recorded(server, trajectory)
    assert [row["endpoint"] for row in rows] == ["responses", "responses"]
    assert len(rows[1]["prompt_token_ids"]) > len(rows[0]["prompt_token_ids"]) + len(rows[0]["output_token_ids"])

    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model=server.model_id, input="hi", previous_response_id="resp_nope")
    assert missing.value.code == "previous_response_not_found"


def test_bad_requests_name_the_parameter(server: ServerProcess) -> None:
    client = openai_client(server, uuid4().hex)
    cases = [
        ({"input": [{"role": "wizard", "content": "hi"}]}, "input[0].role"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "background": True}, "background"),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as bad:
            client.responses.create(model=server.model_id, **extra)
        assert bad.value.param == param, (extra, bad.value.body)


def test_the_translation_matches_vllms_own_responses_route(server: ServerProcess) -> None:
    """Same greedy request to vLLM's `/v1/responses` (direct, with the engine's key) and to ours."""
    engine = engine_connection(server)
    direct = httpx.post(f"{engine.base_url}/v1/responses", headers=engine.headers, timeout=60, json={
        "model": server.model_id, "input": QUESTION, "instructions": "You are terse.", "temperature": 0,
        "max_output_tokens": 12})
    direct.raise_for_status()
    ours = openai_client(server).responses.create(
        model=server.model_id, input=QUESTION, instructions="You are terse.", temperature=0, max_output_tokens=12)
    theirs = direct.json()
    their_text = "".join(part["text"] for item in theirs["output"] if item["type"] == "message" for part in item["content"])
    assert ours.output_text == their_text
    assert ours.usage is not None
    assert (ours.usage.input_tokens, ours.usage.output_tokens) == (
        theirs["usage"]["input_tokens"], theirs["usage"]["output_tokens"])


async def test_an_agents_sdk_run_is_recorded_and_trains(capable_server: ServerProcess) -> None:
    """The OpenAI Agents SDK (Responses and Chat Completions models) runs an agent with a function tool
    against trajectory URLs; the recorded trajectories train a step."""
    server = capable_server  # calls whose arguments the model completes: the full model
    from examples.integrations.agents_sdk import run_weather_agent

    model = trainable_model(server, f"agents-{uuid4().hex[:8]}")
    await model.register()

    async def agent_trajectory(api: Literal["responses", "chat_completions"]) -> art.Trajectory:
        async with model.trajectory() as t:
            # Greedy, so the forced first call always completes (sampled, a 135M model's call can run past
            # max_tokens; the SDK then ends the run after one turn). The reward below makes the signal.
            answer = await run_weather_agent(t.base_url, server.api_key, model.name, api=api, temperature=0.0)
            t.reward = 1.0 if "sunny" in answer.lower() else 0.0
        assert t.exception is None, t.exception
        record = await t.get_record()
        # At least the forced tool call and the turn after the tool's answer.
        assert len(record.completions) >= 2 and {c.endpoint for c in record.completions} == {
            "responses" if api == "responses" else "chat.completions"}
        return t

    # The two runs are independent: at once, the engine batches their turns.
    trajectories = list(await asyncio.gather(agent_trajectory("responses"), agent_trajectory("chat_completions")))
    trajectories[1].reward = (trajectories[0].reward or 0.0) + 1.0  # a signal either way
    result = await model.train([art.TrajectoryGroup(trajectories)], learning_rate=1e-5)
    assert result.trained and result.step == 1
