"""One episode of a job: the row's prompt, the model's turns, tool calls run in the sandbox, next_turn.

The same code rolls out training samples (through a recorded trajectory URL) and evaluation samples
(through the plain API); it only needs an OpenAI client and a model name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import openai

from .datasets import PromptRow
from .rewards import JobReward, Score, UserFunctionFailed
from .spec import RolloutSettings


@dataclass
class Episode:
    messages: list[dict[str, Any]]  # the whole conversation, prompt included
    prompt_length: int
    score: Score | None = None

    @property
    def completion(self) -> list[dict[str, Any]]:
        """What the model added (and the tool results and user turns between): MotteRL's `completion`."""
        return self.messages[self.prompt_length:]


async def run_episode(client: openai.AsyncOpenAI, model: str, row: PromptRow, reward: JobReward,
                      settings: RolloutSettings, *, temperature: float | None = None) -> Episode:
    """Sample the model's turns and score them. Tool calls continue the episode while the module defines
    the tool and turns are left; with `multi_step`, next_turn(messages, **row) gives the next user message."""
    episode = Episode(messages=[dict(m) for m in row.messages], prompt_length=len(row.messages))
    extra: dict[str, Any] = {"tools": row.tools} if row.tools else {}
    for turn in range(settings.max_turns):
        reply = await client.chat.completions.create(
            model=model, messages=episode.messages,  # type: ignore[arg-type]
            max_tokens=settings.max_tokens,
            temperature=settings.temperature if temperature is None else temperature, **extra)
        message = reply.choices[0].message
        episode.messages.append(message.model_dump(exclude_none=True, exclude={"refusal", "audio", "annotations"}))
        last_turn = turn + 1 == settings.max_turns
        if message.tool_calls and row.tools:
            for call in message.tool_calls:
                function = getattr(call, "function", None)
                if function is None:
                    continue
                result = await reward.call_tool(function.name, function.arguments)
                episode.messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            if not last_turn:
                continue
            break
        if not settings.multi_step or last_turn:
            break
        try:
            following = await reward.next_turn(episode.messages, row.item)
        except UserFunctionFailed as failed:
            episode.score = Score(0.0, str(failed))
            return episode
        if following is None:
            break
        episode.messages.append({"role": "user", "content": following})
    episode.score = await reward.score(episode.completion, row.item)
    return episode
