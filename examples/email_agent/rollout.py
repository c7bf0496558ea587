"""One training rollout: the email agent on one question, recorded as an artlike trajectory and rewarded.

    groups = await art.gather_trajectory_groups(
        art.TrajectoryGroup(rollout(model, q, data.db_path) for _ in range(4)) for q in batch)

The agent code is the same `run_agent` that `evaluate.py` points at any OpenAI-compatible endpoint; only
the client differs (`t.async_openai_client()`, which talks through the trajectory's base URL, so the
server records every completion token-exactly).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import artlike as art
from examples.email_agent.agent import DEFAULT_MAX_TOKENS, DEFAULT_MAX_TURNS, grade_result, run_agent
from examples.email_agent.records import Question
from examples.email_agent.reward import DEFAULT_WEIGHTS, AsyncJudge, RewardWeights
from examples.email_agent.tools import EmailTools


async def rollout(
    model: art.TrainableModel,
    question: Question,
    db_path: Path,
    *,
    max_turns: int = DEFAULT_MAX_TURNS,
    temperature: float = 1.0,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    judge: AsyncJudge | None = None,
    weights: RewardWeights = DEFAULT_WEIGHTS,
    first_turn_tool_choice: str | dict[str, Any] | None = None,
    tool_choice: str | None = None,
) -> art.Trajectory:
    """Sets `t.reward` to the total reward and `t.metrics` to every reward component and agent counter."""
    with EmailTools(db_path, question.inbox) as tools:
        async with model.trajectory() as t:
            result = await run_agent(
                t.async_openai_client(), model.name, question, tools, max_turns=max_turns,
                temperature=temperature, max_tokens=max_tokens, first_turn_tool_choice=first_turn_tool_choice,
                tool_choice=tool_choice)
            breakdown = await grade_result(question, result, max_turns, judge, weights)
            t.reward = breakdown.total
            t.metrics = {**result.metrics(), **breakdown.metrics()}
    return t
