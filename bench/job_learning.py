"""A managed job learns: the arithmetic task as a JSONL dataset + a grader, trained by the server itself.

Starts its own `artlike serve` (default model), uploads arithmetic problems (examples/arithmetic/task.py:
two-term sums and differences, the answer in <answer></answer> tags) through the official `openai` SDK,
creates a reinforcement job whose reward is OpenAI grader JSON (a `multi` of math_accuracy and a format
check, no user code; a sample passes at reward >= 0.5, i.e. when it is correct), follows its events, and reports the reward per iteration and the held-out pass rate
(greedy, validation rows the job never trains on) before the first and after the last iteration.

    python -m bench.job_learning [--iterations 12] [--batch-size 8] [--group-size 8]

Prints a table and writes `bench/results/job_learning.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import openai
import orjson
from artlike_server.launcher import ServerProcess

from bench.machine import machine
from examples.arithmetic.task import problems

RESULTS = Path(__file__).resolve().parent / "results" / "job_learning.json"
GRADER = {
    "type": "multi", "name": "arithmetic", "calculate_output": "0.9 * correct + 0.1 * formatted",
    "graders": {
        "correct": {"type": "math_accuracy", "name": "correct", "input": "{{sample.output_text}}",
                    "reference": "{{item.reference_answer}}"},
        "formatted": {"type": "string_check", "name": "formatted", "input": "{{sample.output_text}}",
                      "reference": "</answer>", "operation": "like"},
    },
}


def rows(seed: int, count: int) -> bytes:
    return b"".join(orjson.dumps({"messages": p.messages(), "reference_answer": str(p.answer)}) + b"\n"
                    for p in problems(seed, count))


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as data_dir, \
            ServerProcess(Path(data_dir), args=["--dtype", "auto", "--trainer-dtype", "auto"], api_key="bench") as server:
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="bench", timeout=600)
        train = await client.files.create(file=("train.jsonl", rows(1, args.train_rows)), purpose="fine-tune")
        held_out = await client.files.create(file=("valid.jsonl", rows(2, args.valid_rows)), purpose="fine-tune")
        hyperparameters = {"batch_size": args.batch_size, "eval_interval": args.iterations,
                           "iterations": args.iterations, "group_size": args.group_size, "max_tokens": 16,
                           "learning_rate": args.learning_rate}
        method = {"type": "reinforcement", "reinforcement": {"grader": GRADER, "hyperparameters": hyperparameters}}
        started = time.monotonic()
        job = await client.fine_tuning.jobs.create(model=server.model_id, training_file=train.id,
                                                   validation_file=held_out.id, suffix="arith", seed=0,
                                                   extra_body={"method": method})
        print(f"job {job.id}: {args.iterations} iterations x {args.batch_size} rows x {args.group_size} samples")
        print(f"{'iteration':>9} {'reward':>7} {'loss':>8} {'seconds':>8}")
        seen: set[str] = set()
        while True:
            job = await client.fine_tuning.jobs.retrieve(job.id)
            page = await client.fine_tuning.jobs.list_events(job.id, limit=1000)
            for event in reversed(page.data):
                data = getattr(event, "data", None) or {}
                if event.id in seen or event.type != "metrics" or data.get("eval"):
                    continue
                seen.add(event.id)
                print(f"{data['iteration']:>9} {data['reward_mean']:>7.3f} {data.get('loss', 0.0):>8.4f} "
                      f"{data['seconds']:>8.1f}")
            if job.status in {"succeeded", "failed", "cancelled"}:
                break
            await asyncio.sleep(2)
        wall = time.monotonic() - started
        events = list(reversed((await client.fine_tuning.jobs.list_events(job.id, limit=1000)).data))
        metrics = [dict(getattr(e, "data", None) or {}) for e in events if e.type == "metrics"]
        await client.close()
    evaluations = [m for m in metrics if m.get("eval")]
    iterations = [m for m in metrics if not m.get("eval")]
    report = {
        "status": job.status, "error": job.error.model_dump() if job.error else None, "wall_seconds": round(wall, 1),
        "settings": vars(args), "grader": GRADER,
        "reward_per_iteration": [round(m["reward_mean"], 4) for m in iterations],
        "held_out": {"before": evaluations[0] if evaluations else None,
                     "after": evaluations[-1] if len(evaluations) > 1 else None},
        "machine": machine(),
    }
    before, after = report["held_out"]["before"], report["held_out"]["after"]
    if before and after:
        print(f"held-out pass rate: {before['valid_pass_rate']:.3f} -> {after['valid_pass_rate']:.3f}; "
              f"reward {before['valid_reward_mean']:.3f} -> {after['valid_reward_mean']:.3f} "
              f"({args.valid_rows} problems, greedy)")
    print(f"job {job.status} in {wall:.0f} s")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=2e-4)  # the demo's (examples/arithmetic)
    parser.add_argument("--train-rows", type=int, default=96)
    parser.add_argument("--valid-rows", type=int, default=48)
    report = asyncio.run(run(parser.parse_args()))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
