"""`make demo`: serve the embedded model, train it with GRPO on arithmetic, show the reward rising.

    python -m examples.arithmetic.demo [--steps 12] [--server URL]

Without --server it starts `artlike serve` itself (fresh data dir), registers a model, evaluates it
greedily on held-out problems, runs RL steps (rollouts through the OpenAI client → rewards → train →
hot-swap), then evaluates again and prints a step table and a before/after table. Results go to JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from artlike_server.default_model import DEFAULT_MODEL_ID
from artlike_server.launcher import ServerProcess
from openai import AsyncOpenAI

import artlike as art

from .task import Problem, problems, reward

MAX_TOKENS = 16


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


async def rollout(model: art.TrainableModel, problem: Problem) -> art.Trajectory:
    async with model.trajectory() as t:
        client = t.async_openai_client()
        completion = await client.chat.completions.create(
            model=model.name, messages=problem.messages(), max_tokens=MAX_TOKENS, temperature=1.0)  # type: ignore[arg-type]
        t.reward, t.metrics = reward(problem, completion.choices[0].message.content or "")
    return t


async def evaluate(base_url: str, model: str, eval_set: list[Problem], api_key: str | None) -> dict[str, float]:
    """Greedy accuracy and format rate on held-out problems, through the plain (unrecorded) /v1 API."""
    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key or "artlike")
    limit = asyncio.Semaphore(16)

    async def one(problem: Problem) -> dict[str, float]:
        async with limit:
            completion = await client.chat.completions.create(
                model=model, messages=problem.messages(), max_tokens=MAX_TOKENS, temperature=0.0)  # type: ignore[arg-type]
        return reward(problem, completion.choices[0].message.content or "")[1]

    results = await asyncio.gather(*(one(p) for p in eval_set))
    await client.close()
    return {key: sum(r[key] for r in results) / len(results) for key in ("correct", "formatted")}


async def run(args: argparse.Namespace, base_url: str) -> dict[str, Any]:
    model = art.TrainableModel(name=args.name, base_model=DEFAULT_MODEL_ID, server=base_url,
                               lora=art.LoraConfig(rank=args.lora_rank, alpha=2 * args.lora_rank))
    await model.register()
    eval_set = problems(seed=10_000, count=args.eval_size)
    train_set = problems(seed=args.seed, count=args.steps * args.groups)

    print(f"evaluating step {await model.get_step()} on {len(eval_set)} held-out problems (greedy)...")
    before = await evaluate(base_url, model.name, eval_set, None)
    print(f"  before: accuracy {before['correct']:.1%}, answer format {before['formatted']:.1%}")

    rows: list[dict[str, Any]] = []
    print(f"\n{'step':>4} {'reward':>7} {'correct':>8} {'format':>7} {'loss':>8} {'rollout s':>9} {'train s':>8}")
    for step in range(args.steps):
        batch = train_set[step * args.groups:(step + 1) * args.groups]
        started = time.perf_counter()
        groups = await art.gather_trajectory_groups(
            (art.TrajectoryGroup(rollout(model, p) for _ in range(args.group_size)) for p in batch),
            pbar_desc=f"rollouts {step + 1}/{args.steps}")
        rollout_seconds = time.perf_counter() - started
        trajectories = [t for g in groups for t in g.trajectories]
        mean_reward = _mean([t.reward for t in trajectories])
        started = time.perf_counter()
        result = await model.train(groups, learning_rate=args.learning_rate, progress=False)
        train_seconds = time.perf_counter() - started
        loss = sum(s.loss for s in result.metrics) / max(1, len(result.metrics))
        row = {"step": result.step, "reward": mean_reward,
               "correct": _mean([t.metrics["correct"] for t in trajectories]),
               "formatted": _mean([t.metrics["formatted"] for t in trajectories]), "loss": loss, "rollout_seconds": rollout_seconds,
               "train_seconds": train_seconds}
        rows.append(row)
        print(f"{row['step']:>4} {mean_reward:>7.3f} {row['correct']:>8.1%} {row['formatted']:>7.1%} "
              f"{loss:>8.4f} {rollout_seconds:>9.1f} {train_seconds:>8.1f}")

    after = await evaluate(base_url, model.name, eval_set, None)
    print(f"\nheld-out greedy evaluation ({len(eval_set)} problems)")
    print(f"{'':>10} {'accuracy':>9} {'format':>7}")
    print(f"{'before':>10} {before['correct']:>9.1%} {before['formatted']:>7.1%}")
    print(f"{'after':>10} {after['correct']:>9.1%} {after['formatted']:>7.1%}")
    return {"args": vars(args), "before": before, "after": after, "steps": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", help="use a running server instead of starting one")
    parser.add_argument("--name", default="arithmetic")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--groups", type=int, default=8, help="problems per step")
    parser.add_argument("--group-size", type=int, default=8, help="samples per problem")
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--eval-size", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=Path("examples/arithmetic/results.json"))
    args = parser.parse_args()

    started = time.perf_counter()
    data_dir = Path(tempfile.mkdtemp(prefix="artlike-demo-"))
    launcher = nullcontext() if args.server else ServerProcess(data_dir)
    with launcher as server:
        base_url = args.server or server.base_url  # type: ignore[union-attr]
        if not args.server:
            print(f"server ready at {base_url} after {time.perf_counter() - started:.0f}s (data in {data_dir})")
        results = asyncio.run(run(args, base_url))
    results["total_seconds"] = time.perf_counter() - started
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2, default=str))
    print(f"\ntotal {results['total_seconds'] / 60:.1f} min; results in {args.output}")


if __name__ == "__main__":
    main()
