"""LangChain's `ChatOpenAI` as the agent inside an artlike trajectory: only `base_url`, `model` and
`api_key` change; the chain itself is untouched.

    pip install artlike langchain-openai
    python client/langchain_example.py --server http://127.0.0.1:8000 \
        --base-model HuggingFaceTB/SmolLM2-135M-Instruct

One GRPO step: 2 questions × 4 answers each, rewarded for a short answer that ends a sentence.
"""

from __future__ import annotations

import argparse
import asyncio
import os

from langchain_core.messages import HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI

import artlike as art

QUESTIONS = ["Why is the sky blue?", "What do bees make?"]


def brevity_reward(answer: str) -> float:
    """1 for one short finished sentence, less the longer or less finished it is."""
    text = answer.strip()
    finished = 1.0 if text.endswith((".", "!", "?")) else 0.5
    return finished * max(0.0, 1.0 - len(text) / 200)


async def rollout(model: art.TrainableModel, question: str) -> art.Trajectory:
    async with model.trajectory() as t:
        llm = ChatOpenAI(base_url=t.base_url, model=t.model, api_key=t.api_key, temperature=1.0, max_tokens=32)
        answer = await llm.ainvoke([SystemMessage("Answer in one short sentence."), HumanMessage(question)])
        t.reward = brevity_reward(str(answer.content))
    return t


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", default=os.environ.get("ARTLIKE_SERVER", "http://127.0.0.1:8000"))
    parser.add_argument("--base-model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--name", default="langchain-demo")
    args = parser.parse_args()

    async with art.TrainableModel(args.name, args.base_model, args.server) as model:  # key: $ARTLIKE_API_KEY
        await model.register()
        groups = await art.gather_trajectory_groups(
            art.TrajectoryGroup(rollout(model, question) for _ in range(4)) for question in QUESTIONS)
        result = await model.train(groups, learning_rate=1e-5)
        print(f"trained step {result.step}: the chain now talks to {result.model}")


if __name__ == "__main__":
    asyncio.run(main())
