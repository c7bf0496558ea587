"""Tool calling on by default: the session server runs with no tool flags (tests/conftest.py), and every
`tool_choice` works through the official `openai` SDK and LangChain on trajectory URLs; a multi-turn tool
trajectory is recorded token-exact (each prompt is the engine's own tokenization of the conversation) and
trains a step. Uses the session fixture `capable_server`."""

from __future__ import annotations

import asyncio
import json
from typing import Any
from uuid import uuid4

import httpx
import pytest
from artlike_server.launcher import ServerProcess

import artlike as art

from .engine_helpers import engine_connection
from .helpers import api_url, openai_client, recorded, trainable_model

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server(capable_server: ServerProcess) -> ServerProcess:
    """Tool calls the model chooses, with arguments it completes: the full embedded model."""
    return capable_server

# strict: vLLM constrains the arguments to the schema. Without it a forced call's arguments are free JSON, and
# the 135M model's often run past max_tokens (then no call can be parsed).
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city.", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather and the time in Paris?"}]


def well_formed(call: Any, names: set[str]) -> None:
    assert call.type == "function" and call.id and call.function.name in names
    assert isinstance(json.loads(call.function.arguments), dict)


@pytest.mark.parametrize("tool_choice", ["auto", "required", "none", "named"])
def test_every_tool_choice_works_on_the_default_server(server: ServerProcess, tool_choice: str) -> None:
    trajectory = uuid4().hex
    choice: Any = {"type": "function", "function": {"name": "get_time"}} if tool_choice == "named" else tool_choice
    reply = openai_client(server, trajectory).chat.completions.create(
        model=server.model_id, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,  # type: ignore[list-item,arg-type]
        temperature=0, max_tokens=96)
    calls = reply.choices[0].message.tool_calls or []
    if tool_choice == "none":
        assert calls == []
    elif tool_choice == "named":
        assert [call.function.name for call in calls] == ["get_time"]  # type: ignore[union-attr]
    elif tool_choice == "required":
        assert calls  # guided decoding: at least one call, however weak the model
    for call in calls:  # "auto": the model may answer in text; any call it makes is well-formed
        well_formed(call, {"get_weather", "get_time"})
    [row] = recorded(server, trajectory)
    assert row["request"]["tool_choice"] == choice and len(row["logprobs"]) == len(row["output_token_ids"])


def test_parallel_tool_calls_can_be_limited_to_one(server: ServerProcess) -> None:
    client = openai_client(server, uuid4().hex)
    single = client.chat.completions.create(
        model=server.model_id, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",  # type: ignore[list-item,arg-type]
        parallel_tool_calls=False, temperature=0, max_tokens=96)
    assert len(single.choices[0].message.tool_calls or []) == 1
    several = client.chat.completions.create(
        model=server.model_id, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",  # type: ignore[list-item,arg-type]
        temperature=0, max_tokens=160)
    calls = several.choices[0].message.tool_calls or []
    assert calls  # one or more: the hermes parser returns every call of the answer
    for call in calls:
        well_formed(call, {"get_weather", "get_time"})


def test_langchain_bind_tools_works_and_is_recorded(server: ServerProcess) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return f"Sunny in {city}"

    trajectory = uuid4().hex
    llm = ChatOpenAI(base_url=api_url(server, trajectory), api_key=server.api_key,  # type: ignore[arg-type]
                     model=server.model_id, temperature=0, max_tokens=64, max_retries=0)
    reply = llm.bind_tools([get_weather], tool_choice="get_weather", strict=True).invoke("What is the weather in Paris?")
    assert [call["name"] for call in reply.tool_calls] == ["get_weather"]  # type: ignore[attr-defined]
    assert len(recorded(server, trajectory)) == 1


async def test_a_multi_turn_tool_trajectory_is_token_exact_and_trains(server: ServerProcess) -> None:
    engine = engine_connection(server)
    model = trainable_model(server, f"tools-{uuid4().hex[:8]}")
    await model.register()

    async def tool_trajectory(reward: float) -> art.Trajectory:
        async with model.trajectory() as t:
            client = t.async_openai_client()
            messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]
            first = await client.chat.completions.create(
                model=model.name, messages=messages, tools=[WEATHER],  # type: ignore[arg-type,list-item]
                tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=48,
                temperature=0)  # greedy: the forced call always completes within max_tokens
            [call] = first.choices[0].message.tool_calls or []
            messages += [first.choices[0].message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
            second = await client.chat.completions.create(model=model.name, messages=messages,  # type: ignore[arg-type]
                                                          tools=[WEATHER], max_tokens=16,  # type: ignore[list-item]
                                                          temperature=0)
            t.reward = reward + len(second.choices[0].message.content or "") / 1000
        assert t.exception is None, t.exception
        rows = (await t.get_record()).completions
        assert len(rows) == 2
        # Each recorded prompt is exactly the engine's tokenization of the conversation at that turn.
        async with httpx.AsyncClient(base_url=engine.base_url, headers=engine.headers, timeout=30) as direct:
            for row, turn_messages in zip(rows, (messages[:1], messages), strict=True):
                tokenized = (await direct.post("/tokenize", json={
                    "model": server.model_id, "messages": turn_messages, "tools": [WEATHER],
                    "add_generation_prompt": True})).json()
                assert row.prompt_token_ids == tokenized["tokens"]
            assert len(row.logprobs) == len(row.output_token_ids) > 0
        return t

    # The two trajectories are independent: sampled at once, the engine batches their turns.
    trajectories = await asyncio.gather(tool_trajectory(1.0), tool_trajectory(0.0))
    result = await model.train([art.TrajectoryGroup(trajectories)], learning_rate=1e-5, progress=False)
    assert result.trained and result.step == 1
    assert result.start is not None and result.start.sequences >= 2
