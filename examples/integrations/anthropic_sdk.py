"""The `anthropic` SDK against artlike: a tool-using conversation recorded through a trajectory URL.

The SDK's `base_url` is the server root, so a trajectory's is `{server}/t/{id}` (`t.base_url` without its
`/v1`); the key goes as `x-api-key`, which artlike accepts like `Authorization: Bearer`.

    async with model.trajectory() as t:
        answer = await run_weather_turns(t.base_url.removesuffix("/v1"), api_key, model.name)
        t.reward = score(answer)
"""

from __future__ import annotations

from typing import Any

import anthropic

WEATHER_TOOL: dict[str, Any] = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


async def run_weather_turns(base_url: str, api_key: str, model: str, *, question: str = "Weather in Paris?",
                            temperature: float = 1.0) -> str:
    """Two turns: a forced `get_weather` call, then the answer given its result. Returns the answer's text.
    (Recent `anthropic` SDKs take sampling parameters only through `extra_body`.)"""
    sampling = {"temperature": temperature}
    async with anthropic.AsyncAnthropic(base_url=base_url, api_key=api_key, max_retries=0) as client:
        messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
        first = await client.messages.create(
            model=model, max_tokens=64, messages=messages, tools=[WEATHER_TOOL],  # type: ignore[arg-type,list-item]
            tool_choice={"type": "tool", "name": "get_weather"}, extra_body=sampling)
        calls = [block for block in first.content if block.type == "tool_use"]
        if not calls:
            return ""
        messages += [
            {"role": "assistant", "content": [block.model_dump() for block in first.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                          "content": f"Sunny, 21 C in {call.input.get('city', '?')}."}  # type: ignore[union-attr]
                                         for call in calls]},
        ]
        second = await client.messages.create(model=model, max_tokens=48, messages=messages,  # type: ignore[arg-type]
                                              tools=[WEATHER_TOOL], extra_body=sampling)  # type: ignore[list-item]
        return "".join(block.text for block in second.content if block.type == "text")
