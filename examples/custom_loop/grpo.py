"""A GRPO loop written on the training primitives (`art.TrainingSession`), not on `/_train_model`.

    python -m examples.custom_loop.grpo --server http://127.0.0.1:8000 [--iterations 4 --group-size 4]

Each iteration samples a group of answers per arithmetic problem from the session's last saved step,
scores them, turns rewards into group-relative advantages, runs `forward_backward` (the `ppo` loss: GRPO's
clipped token-ratio loss) on the recorded trajectories, one `optim_step`, and saves the step it samples
from next. The loop is yours: swap the advantage estimator, the loss or the schedule.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics

import artlike as art
from examples.arithmetic.task import problems, reward


async def train(model: art.TrainableModel, *, iterations: int, group_size: int, questions: int) -> list[str]:
    """Returns the step each iteration sampled from (\"name@N\"), then the last one saved."""
    samplers = []
    async with await model.training_session(learning_rate=5e-5) as session:
        sampler = f"{model.name}@{session.info.step}"
        for iteration in range(iterations):
            samplers.append(sampler)
            batch, rewards = [], []
            for problem in problems(seed=iteration, count=questions):
                group = []
                for _ in range(group_size):
                    async with model.trajectory() as t:
                        reply = await t.async_openai_client().chat.completions.create(
                            model=sampler, messages=problem.messages(), max_tokens=16, temperature=1.0)  # type: ignore[arg-type]
                    group.append((t, reward(problem, reply.choices[0].message.content or "")[0]))
                mean = statistics.fmean(r for _, r in group)
                std = statistics.pstdev(r for _, r in group) or 1.0
                batch += [(t, (r - mean) / std) for t, r in group if r != mean]  # zero advantage: no signal
                rewards += [r for _, r in group]
            if batch:
                await session.forward_backward(trajectories=batch, loss="ppo")
                await session.optim_step()
                sampler = (await session.save_state()).model  # "name@N": sample from the new weights
            print(f"iteration {iteration}: mean reward {statistics.fmean(rewards):.3f}, next samples from {sampler}")
    return [*samplers, sampler]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", default=os.environ.get("ARTLIKE_SERVER", "http://127.0.0.1:8000"))
    parser.add_argument("--base-model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--model", default="custom-loop")
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--questions", type=int, default=4)
    args = parser.parse_args()
    model = art.TrainableModel(args.model, args.base_model, args.server)
    asyncio.run(model.register())
    asyncio.run(train(model, iterations=args.iterations, group_size=args.group_size, questions=args.questions))


if __name__ == "__main__":
    main()
