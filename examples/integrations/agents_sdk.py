"""The OpenAI Agents SDK against artlike: an agent with a function tool, recorded through a trajectory URL.

Both of the SDK's model classes work: `OpenAIResponsesModel` calls `/v1/responses`, and
`OpenAIChatCompletionsModel` calls `/v1/chat/completions`; only the client's `base_url` changes.

    async with model.trajectory() as t:
        answer = await run_weather_agent(t.base_url, api_key, model.name)
        t.reward = score(answer)
"""

from __future__ import annotations

from typing import Literal

from agents import (
    Agent,
    MaxTurnsExceeded,
    ModelBehaviorError,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

set_tracing_disabled(True)  # traces would go to OpenAI's servers; nothing here leaves the machine


@function_tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"Sunny, 21 C in {city}."


async def run_weather_agent(
    base_url: str,
    api_key: str,
    model: str,
    *,
    api: Literal["responses", "chat_completions"] = "responses",
    question: str = "What is the weather in Paris?",
    temperature: float = 1.0,
) -> str:
    """The agent's final answer: a forced first tool call (the SDK resets `tool_choice` after it), then an
    answer ("" when the run failed: see below)."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    llm = (
        OpenAIResponsesModel(model=model, openai_client=client)
        if api == "responses"
        else OpenAIChatCompletionsModel(model=model, openai_client=client)
    )
    agent = Agent(
        name="weather",
        instructions="Answer weather questions. Call get_weather, then answer in one sentence.",
        tools=[get_weather],
        model=llm,
        model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=96,
                                     temperature=temperature),
    )
    try:
        result = await Runner.run(agent, question, max_turns=4)
        return str(result.final_output)
    except (MaxTurnsExceeded, ModelBehaviorError):
        # A small model may keep calling the tool, or run out of tokens mid-answer (the Responses model raises
        # on an `incomplete` response): every turn is recorded all the same, and scores as a failure.
        return ""
    finally:
        await client.close()
