"""What every framework example shares: one agent run inside an artlike trajectory, and a one-step GRPO demo.

An example defines `run(base_url, model, api_key) -> str`: the framework, pointed at a trajectory URL
(`{server}/t/{id}/v1`), does its task and returns the final answer, the input of the reward. Only
`base_url`, `model` and `api_key` are artlike's; the rest is the framework's own code.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Awaitable, Callable

import artlike as art

Agent = Callable[[str, str, str], Awaitable[str]]
"""(base_url, model, api_key) -> the agent's final answer."""


def brevity_reward(answer: str) -> float:
    """1 for one short finished sentence, less the longer or less finished it is."""
    text = answer.strip()
    finished = 1.0 if text.endswith((".", "!", "?")) else 0.5
    return finished * max(0.0, 1.0 - len(text) / 200)


async def rollout(model: art.TrainableModel, agent: Agent,
                  reward: Callable[[str], float] = brevity_reward) -> art.Trajectory:
    async with model.trajectory() as t:
        t.reward = reward(await agent(t.base_url, t.model, t.api_key or "unused"))
    return t


def demo(agent: Agent, name: str, description: str | None = None) -> None:
    """The command line of an example: register a model, roll out a group of 4, train one step."""
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", default=os.environ.get("ARTLIKE_SERVER", "http://127.0.0.1:8000"))
    parser.add_argument("--base-model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--name", default=name)
    args = parser.parse_args()

    async def main() -> None:
        async with art.TrainableModel(args.name, args.base_model, args.server) as model:  # key: $ARTLIKE_API_KEY
            await model.register()
            groups = await art.gather_trajectory_groups(
                [art.TrajectoryGroup(rollout(model, agent) for _ in range(4))])
            result = await model.train(groups, learning_rate=1e-5)
            print(f"trained step {result.step}: the agent now talks to {result.model}")

    asyncio.run(main())
