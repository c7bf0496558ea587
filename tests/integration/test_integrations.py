"""The framework examples of examples/integrations/ against the real server: each runs its framework through
two trajectory URLs, and the group of two trajectories it recorded trains one step.

Rewards are fixed (1 and 0) so the group always carries a GRPO signal: what is under test is that every
framework's calls are recorded and trainable, not what the model answers."""

from __future__ import annotations

import asyncio
import importlib
from uuid import uuid4

import pytest
from artlike_server.launcher import ServerProcess

import artlike as art
from examples.integrations.common import rollout

from .helpers import trainable_model

pytestmark = pytest.mark.integration

EXAMPLES = {"langchain_example": "langchain_openai", "langgraph_example": "langgraph",
            "litellm_example": "litellm"}


@pytest.mark.parametrize("example", sorted(EXAMPLES))
async def test_the_example_records_a_group_that_trains_one_step(server: ServerProcess, example: str) -> None:
    module = importlib.import_module(f"examples.integrations.{example}")
    model = trainable_model(server, f"{example.removesuffix('_example')}-{uuid4().hex[:8]}")
    await model.register()

    trajectories = await asyncio.gather(*(rollout(model, module.run, lambda _answer, r=reward: r)
                                          for reward in (1.0, 0.0)))
    for trajectory in trajectories:
        assert not trajectory.failed, repr(trajectory.exception)
        completions = (await trajectory.get_record()).completions
        assert completions, "the framework's calls went through the trajectory URL"
        for completion in completions:
            assert (completion.endpoint, completion.served_model, completion.step) == (
                "chat.completions", f"{model.name}@0", 0)
            assert len(completion.output_token_ids) == len(completion.logprobs) > 0

    result = await model.train([art.TrajectoryGroup(trajectories)], learning_rate=1e-5, progress=False)
    assert (result.step, result.trained) == (1, True)
    assert result.start is not None and (result.start.trajectories, result.start.groups_skipped) == (2, 0)
