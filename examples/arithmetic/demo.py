"""`make demo`: serve the embedded model, train it with GRPO on arithmetic, show the reward rising.

    python -m examples.arithmetic.demo [--steps 12] [--server URL]

Without --server it starts `artlike serve` itself (fresh data dir), registers a model, evaluates it
greedily on held-out problems, trains with `art.PipelineTrainer` (rollouts through the OpenAI client →
rewards → train → hot-swap, the next step's rollouts running while a step trains), then evaluates again and
prints a step table (with each step's staleness and times) and a before/after table. Results go to JSON in
the run's data dir (`--output` to choose).
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
from artlike_server.engine.launch import detect_device
from artlike_server.launcher import ServerProcess
from openai import AsyncOpenAI

import artlike as art

from .task import HELD_OUT_SEED, TRAINING_SEED, Problem, problems, reward

MAX_TOKENS = 16



async def rollout(model: art.TrainableModel, problem: Problem) -> art.Trajectory:
    async with model.trajectory() as t:
        client = t.async_openai_client()
        completion = await client.chat.completions.create(
            model=model.name, messages=problem.messages(), max_tokens=MAX_TOKENS,  # type: ignore[arg-type]
            temperature=art.rollout_temperature(1.0))  # hotter in a retry of an all-wrong group (--retry-failed)
        t.reward, t.metrics = reward(problem, completion.choices[0].message.content or "")
    return t


def reference(problem: Problem) -> art.Trajectory:
    """The right answer, for a problem no rollout of its group got right: the group learns from it."""
    solved = problem.solved()
    value, metrics = reward(problem, solved[-1]["content"])
    return art.Trajectory(solved, reward=value, metrics=metrics)


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


def print_header() -> None:
    print(f"\n{'step':>4} {'reward':>7} {'correct':>8} {'format':>7} {'loss':>8} {'entropy':>7} {'zero-var':>8} "
          f"{'guided':>6} {'rescued':>7} {'stale':>6} {'rollout s':>9} {'train s':>8} {'step s':>7}")


def _print_row(report: art.PipelineStep) -> None:
    # entropy falling and zero-var rising: the policy answers each problem the same way, so groups teach nothing
    entropy = "—" if report.entropy is None else f"{report.entropy:.3f}"
    zero_variance = "—" if report.zero_variance_fraction is None else f"{report.zero_variance_fraction:.0%}"
    print(f"{report.step:>4} {report.reward_mean:>7.3f} {report.metrics.get('correct', 0.0):>8.1%} "
          f"{report.metrics.get('formatted', 0.0):>7.1%} {report.loss or 0.0:>8.4f} {entropy:>7} {zero_variance:>8} "
          f"{report.groups_guided:>6} {report.groups_rescued:>7} {report.staleness_mean:>6.2f} "
          f"{report.rollout_seconds:>9.1f} {report.train_seconds:>8.1f} {report.step_seconds:>7.1f}"
          + ("" if report.trained else f"  not trained: {report.reason}"))


async def run(args: argparse.Namespace, base_url: str) -> dict[str, Any]:
    model = art.TrainableModel(name=args.name, base_model=DEFAULT_MODEL_ID, server=base_url,
                               lora=art.LoraConfig(rank=args.lora_rank, alpha=2 * args.lora_rank))
    await model.register()
    eval_set = problems(seed=HELD_OUT_SEED, count=args.eval_size)
    train_set = problems(seed=args.seed, count=(args.steps + args.max_steps_off_policy + 4) * args.groups)

    print(f"evaluating step {await model.get_step()} on {len(eval_set)} held-out problems (greedy)...")
    before = await evaluate(base_url, model.name, eval_set, None)
    print(f"  before: accuracy {before['correct']:.1%}, answer format {before['formatted']:.1%}")

    # Rollouts of the next step run while a step trains (max_steps_off_policy=1); `stale` is how many steps
    # behind the trained policy the step's samples were drawn, corrected by the importance ratio.
    trainer = art.PipelineTrainer(
        model, lambda problem: rollout(model, problem), train_set, group_size=args.group_size,
        groups_per_step=args.groups, max_steps_off_policy=args.max_steps_off_policy,
        learning_rate=args.learning_rate, on_step=_print_row, progress=False,
        guide=reference if args.guide else None,
        retry_failed=art.RetryFailedGroups() if args.retry_failed else None)
    print_header()
    result = await trainer.run(num_steps=args.steps)

    after = await evaluate(base_url, model.name, eval_set, None)
    print(f"\nheld-out greedy evaluation ({len(eval_set)} problems)")
    print(f"{'':>10} {'accuracy':>9} {'format':>7}")
    print(f"{'before':>10} {before['correct']:>9.1%} {before['formatted']:>7.1%}")
    print(f"{'after':>10} {after['correct']:>9.1%} {after['formatted']:>7.1%}")
    print(f"engine busy {result.engine_busy_fraction:.0%} of the run, trainer busy {result.trainer_busy_fraction:.0%}")
    return {"args": vars(args), "before": before, "after": after, "pipeline": result.model_dump(mode="json")}


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
    parser.add_argument("--seed", type=int, default=TRAINING_SEED)
    parser.add_argument("--max-steps-off-policy", type=int, default=None,
                        help="0: the sequential loop; 1: sample the next step while one trains. Default: 1 on a "
                             "GPU, 0 on a CPU, where the engine and the trainer share the same cores and overlapping "
                             "them is slower per step (bench/rl_step.py measures both)")
    parser.add_argument("--guide", action=argparse.BooleanOptionalAction, default=False,
                        help="add the right answer to a group whose samples were all wrong (off-policy guidance)")
    parser.add_argument("--retry-failed", action=argparse.BooleanOptionalAction, default=False,
                        help="roll a group whose samples were all wrong out again at temperature 1.5; the retry "
                             "joins it when one of its samples is right")
    parser.add_argument("--output", type=Path, help="results JSON (default: results.json in the run's data dir)")
    args = parser.parse_args()
    if args.max_steps_off_policy is None:
        args.max_steps_off_policy = 1 if detect_device() == "cuda" else 0

    started = time.perf_counter()
    data_dir = Path(tempfile.mkdtemp(prefix="artlike-demo-"))
    launcher = nullcontext() if args.server else ServerProcess(data_dir)
    with launcher as server:
        base_url = args.server or server.base_url  # type: ignore[union-attr]
        if not args.server:
            print(f"server ready at {base_url} after {time.perf_counter() - started:.0f}s (data in {data_dir})")
        results = asyncio.run(run(args, base_url))
    results["total_seconds"] = time.perf_counter() - started
    output = args.output or data_dir / "results.json"  # outside the source tree unless asked
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=2, default=str))
    print(f"\ntotal {results['total_seconds'] / 60:.1f} min; results in {output}")


if __name__ == "__main__":
    main()
