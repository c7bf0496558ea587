"""What bench/ceiling.py and bench/plateau.py share: the demo task's training pool and held-out set, the server
they start, and the held-out accuracy of a served model, greedy and sampled at temperature 1."""

from __future__ import annotations

import asyncio
from typing import Any

from openai import AsyncOpenAI

from examples.arithmetic.demo import MAX_TOKENS
from examples.arithmetic.task import HELD_OUT_SEED, TRAINING_SEED, Problem, every_problem, problems, reward

LORA_RANK = 8  # the demo's


def server_args(model: str | None) -> list[str]:
    """`artlike serve`'s options for these benches: the machine's own dtypes (bfloat16 on a GPU or a CPU with
    native BF16), and `model`, a Hugging Face model directory, in place of the embedded default.

    >>> server_args(None)
    ['--dtype', 'auto', '--trainer-dtype', 'auto']
    >>> server_args("/models/Qwen2.5-0.5B-Instruct")[-2:]
    ['--model', '/models/Qwen2.5-0.5B-Instruct']
    """
    return ["--dtype", "auto", "--trainer-dtype", "auto", *(["--model", model] if model else [])]


def training_pool(size: int) -> list[Problem]:
    return problems(seed=TRAINING_SEED, count=size)


def held_out(size: int) -> list[Problem]:
    return problems(seed=HELD_OUT_SEED, count=size)


async def answers(base_url: str, api_key: str, model: str, eval_set: list[Problem], *, temperature: float,
                  seed: int = 0) -> list[int]:
    """1 for each problem of `eval_set` the served `model` answers right (one sample per problem), else 0."""
    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key)
    limit = asyncio.Semaphore(16)

    async def one(index: int, problem: Problem) -> int:
        async with limit:
            completion = await client.chat.completions.create(
                model=model, messages=problem.messages(), max_tokens=MAX_TOKENS,  # type: ignore[arg-type]
                temperature=temperature, seed=seed + index)
        return int(reward(problem, completion.choices[0].message.content or "")[1]["correct"])

    try:
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(eval_set)))
    finally:
        await client.close()


async def accuracy(base_url: str, api_key: str, model: str, eval_set: list[Problem], *, temperature: float,
                   seed: int = 0) -> float:
    """The share of `eval_set` the served `model` answers right (one sample per problem)."""
    right = await answers(base_url, api_key, model, eval_set, temperature=temperature, seed=seed)
    return sum(right) / len(right)


async def greedy_and_sampled(base_url: str, api_key: str, model: str, eval_set: list[Problem]) -> dict[str, Any]:
    """Greedy and temperature-1 accuracy, and which problems greedy decoding got right (`greedy_right`, a string
    of 0s and 1s in `eval_set`'s order: two models' differences can then be compared problem by problem).

    It adds the expected greedy accuracy over the task itself (`greedy_task`): every distinct
    problem, each weighted by the chance a draw is that problem. Held-out accuracy estimates it from a sample
    of the problems, with a sampling error of a few points; this is the model's exact value."""
    greedy = await answers(base_url, api_key, model, eval_set, temperature=0.0)
    task = every_problem()
    right = await answers(base_url, api_key, model, [problem for problem, _ in task], temperature=0.0)
    return {"greedy": sum(greedy) / len(greedy),
            "sampled": await accuracy(base_url, api_key, model, eval_set, temperature=1.0),
            "greedy_right": "".join(map(str, greedy)),
            "greedy_task": sum(chance for (_, chance), one in zip(task, right, strict=True) if one)}
