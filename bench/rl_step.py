"""Sequential RL loop vs the pipeline (`art.PipelineTrainer`), same task, same model, same wall-clock budget.

Each mode trains a fresh LoRA of the default model on the arithmetic task (examples/arithmetic/task.py) with
64 trajectories per step (8 problems × 8 samples, ≤ 32 new tokens, temperature 1, lr 2e-4) for the same
wall-clock budget, on one server started with `--dtype auto`:

- `sequential`: `max_steps_off_policy=0` — all of a step's rollouts, then its training, then the next;
- `pipeline`: `max_steps_off_policy=1` — the next step's rollouts sample while a step trains.

Per mode: seconds per step (median, the first step excluded: it pays the trainer's warm-up), steps done,
the engine's and the trainer's idle fractions (share of the run with no rollout / no training step in flight,
seen from the client), and the reward after the budget: greedy accuracy on 100 held-out problems of the
final step, and the sampled reward of the last two steps. `--core-split` adds a second server whose engine
is pinned to core 0 and trainer to core 1 (`--engine-cpus 0 --trainer-cpus 1`) and runs the pipeline there.
`--policy-engine` adds a server with a policy engine (`--engines 1 --policy-engines 1`: rollouts of the
trained step from merged weights, docs/scale-out.md) and runs both modes there.

    python -m bench.rl_step [--budget-seconds 600] [--quick] [--core-split] [--policy-engine]

Prints a table and writes `bench/results/rl_step.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from artlike_server.launcher import ServerProcess
from openai import AsyncOpenAI

import artlike as art
from bench.machine import machine
from examples.arithmetic.task import Problem, problems, reward

RESULTS = Path(__file__).resolve().parent / "results" / "rl_step.json"
MAX_TOKENS = 32
GROUP_SIZE, GROUPS_PER_STEP = 8, 8
LEARNING_RATE = 2e-4
EVAL_PROBLEMS = 100


async def rollout(model: art.TrainableModel, problem: Problem) -> art.Trajectory:
    async with model.trajectory() as t:
        client = t.async_openai_client(timeout=600)
        completion = await client.chat.completions.create(
            model=t.model, messages=problem.messages(), max_tokens=MAX_TOKENS, temperature=1.0)  # type: ignore[arg-type]
        t.reward, t.metrics = reward(problem, completion.choices[0].message.content or "")
    return t


async def greedy_accuracy(base_url: str, api_key: str, model: str) -> float:
    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, timeout=600)
    limit = asyncio.Semaphore(16)

    async def one(problem: Problem) -> float:
        async with limit:
            completion = await client.chat.completions.create(
                model=model, messages=problem.messages(), max_tokens=MAX_TOKENS, temperature=0.0)  # type: ignore[arg-type]
        return reward(problem, completion.choices[0].message.content or "")[1]["correct"]

    scores = await asyncio.gather(*(one(p) for p in problems(seed=10_000, count=EVAL_PROBLEMS)))
    await client.close()
    return sum(scores) / len(scores)


async def run_mode(server: ServerProcess, name: str, max_off: int, budget: float) -> dict[str, Any]:
    assert server.api_key is not None
    model = art.TrainableModel(name, server.model_id, server.base_url, api_key=server.api_key,
                               lora=art.LoraConfig(rank=8, alpha=16))
    await model.register()
    train_set = problems(seed=0, count=GROUPS_PER_STEP * 400)
    trainer = art.PipelineTrainer(model, lambda p: rollout(model, p), train_set, group_size=GROUP_SIZE,
                                  groups_per_step=GROUPS_PER_STEP, max_steps_off_policy=max_off, progress=False,
                                  learning_rate=LEARNING_RATE,
                                  on_step=lambda s: print(f"  {name} step {s.step}: reward {s.reward_mean:.3f} "
                                                          f"stale {s.staleness_mean:.2f} rollout {s.rollout_seconds:.1f}s "
                                                          f"train {s.train_seconds:.1f}s step {s.step_seconds:.1f}s"))
    result = await trainer.run(max_seconds=budget)
    accuracy = await greedy_accuracy(server.base_url, server.api_key, f"{name}@{result.final_step}")
    step_seconds = [s.step_seconds for s in result.steps[1:]] or [s.step_seconds for s in result.steps]
    last = result.steps[-2:]
    return {
        "mode": name, "max_steps_off_policy": max_off, "steps": len(result.steps),
        "seconds_per_step": statistics.median(step_seconds) if step_seconds else None,
        "engine_idle": 1 - result.engine_busy_fraction, "trainer_idle": 1 - result.trainer_busy_fraction,
        "held_out_accuracy": accuracy,
        "sampled_reward_last_steps": statistics.fmean(s.reward_mean for s in last) if last else None,
        "staleness_mean": statistics.fmean(s.staleness_mean for s in result.steps) if result.steps else None,
        "wall_seconds": result.wall_seconds,
        "per_step": [s.model_dump(mode="json", exclude={"metrics"}) for s in result.steps],
    }


async def warm_up(server: ServerProcess) -> None:
    """One small step first, so neither mode pays the engine's and the trainer's first-use costs."""
    assert server.api_key is not None
    model = art.TrainableModel("warmup", server.model_id, server.base_url, api_key=server.api_key)
    await model.register()
    await art.PipelineTrainer(model, lambda p: rollout(model, p), problems(seed=99, count=8), group_size=4,
                              groups_per_step=2, max_steps_off_policy=0, progress=False).run(num_steps=1)


async def run_server(args: argparse.Namespace, extra: list[str], modes: list[tuple[str, int]]) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as data_dir, \
            ServerProcess(Path(data_dir), args=["--dtype", "auto", "--trainer-dtype", "auto", *extra],
                          api_key="bench") as server:
        await warm_up(server)
        rows = []
        for name, max_off in modes:
            print(f"{name}: {args.budget_seconds:.0f} s budget, max_steps_off_policy={max_off} {' '.join(extra)}")
            row = await run_mode(server, name, max_off, args.budget_seconds)
            row["server_args"] = extra
            rows.append(row)
        return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'mode':<18} {'steps':>5} {'s/step':>7} {'engine idle':>11} {'trainer idle':>12} {'stale':>6} "
          f"{'held-out acc':>12} {'sampled reward':>14}")
    for row in rows:
        print(f"{row['mode']:<18} {row['steps']:>5} {row['seconds_per_step'] or 0:>7.1f} {row['engine_idle']:>11.0%} "
              f"{row['trainer_idle']:>12.0%} {row['staleness_mean'] or 0:>6.2f} {row['held_out_accuracy']:>12.1%} "
              f"{row['sampled_reward_last_steps'] or 0:>14.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-seconds", type=float, default=600.0)
    parser.add_argument("--quick", action="store_true", help="a 150 s budget per mode")
    parser.add_argument("--json", type=Path, default=RESULTS, help="where the results go")
    parser.add_argument("--core-split", action="store_true", help="also: the pipeline with engine and trainer "
                                                                  "pinned to separate cores")
    parser.add_argument("--policy-engine", action="store_true", help="also: both modes with a policy engine "
                        "(--engines 1 --policy-engines 1: the policy's rollouts from merged weights, one core each)")
    args = parser.parse_args()
    if args.quick:
        args.budget_seconds = 150.0
    started = time.perf_counter()
    rows = asyncio.run(run_server(args, [], [("sequential", 0), ("pipeline", 1)]))
    if args.core_split:
        rows += asyncio.run(run_server(args, ["--engine-cpus", "0", "--trainer-cpus", "1"], [("pipeline-split", 1)]))
    if args.policy_engine:
        rows += asyncio.run(run_server(args, ["--engines", "1", "--policy-engines", "1"],
                                       [("sequential-policy", 0), ("pipeline-policy", 1)]))
    print_table(rows)
    sequential, pipeline = rows[0], rows[1]
    ratio = (pipeline["seconds_per_step"] / sequential["seconds_per_step"]
             if pipeline["seconds_per_step"] and sequential["seconds_per_step"] else None)
    if ratio is not None:
        print(f"\npipeline / sequential seconds per step: {ratio:.2f} (target <= 0.7)")
    report = {"budget_seconds": args.budget_seconds, "pipeline_over_sequential_step_time": ratio, "modes": rows,
              "wall_seconds": time.perf_counter() - started,
              "machine": machine()}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
