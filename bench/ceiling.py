"""The ceiling RL is measured against: the demo's model trained by SFT on the right answers of the whole
training pool of the arithmetic task (examples/arithmetic), and its held-out greedy accuracy.

Starts its own `artlike serve` (the default model, or `--model DIR`), registers a model with the demo's LoRA
budget, then passes over the pool (`--pool-size` problems, the demo's seed) in batches of `--batch-size`
examples, one training step each, the prompt the demo's and the target `<answer>N</answer>`; after every pass
it evaluates held-out problems (the demo's, greedy and at temperature 1) and greedy decoding over the whole
task, until `--epochs` passes or `--budget-minutes` of training are done. The best held-out greedy accuracy is
the ceiling: what the model can hold within this LoRA budget.

    python -m bench.ceiling [--budget-minutes 15] [--epochs 6] [--pool-size 1024] [--model DIR]

Prints a table and writes `bench/results/ceiling.json` (`--output` to choose).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from artlike_server.launcher import ServerProcess

import artlike as art
from bench.arithmetic import LORA_RANK, greedy_and_sampled, held_out, server_args, training_pool
from bench.machine import machine

RESULTS = Path(__file__).resolve().parent / "results" / "ceiling.json"
KEY = "bench"


async def run(args: argparse.Namespace) -> dict[str, Any]:
    pool, eval_set = training_pool(args.pool_size), held_out(args.eval_size)
    with tempfile.TemporaryDirectory() as data_dir, \
            ServerProcess(Path(data_dir), args=server_args(args.model), api_key=KEY) as server:
        model = art.TrainableModel(name="ceiling", base_model=server.model_id, server=server.base_url, api_key=KEY,
                                   lora=art.LoraConfig(rank=LORA_RANK, alpha=2 * LORA_RANK))
        await model.register()
        before = await greedy_and_sampled(server.base_url, KEY, model.name, eval_set)
        print(f"{'pass':>4} {'steps':>5} {'train s':>8} {'loss':>7} {'greedy':>7} {'T=1':>6} "
              f"{'whole task':>11}")
        print(f"{0:>4} {0:>5} {0.0:>8.0f} {'':>7} {before['greedy']:>7.1%} {before['sampled']:>6.1%} "
              f"{before['greedy_task']:>11.1%}")
        passes: list[dict[str, Any]] = []
        trained_seconds, steps, out_of_time = 0.0, 0, False
        for epoch in range(1, args.epochs + 1):
            losses: list[float] = []
            for start in range(0, len(pool), args.batch_size):
                if trained_seconds >= args.budget_minutes * 60:
                    out_of_time = True
                    break
                began = time.perf_counter()
                result = await model.train_sft(
                    [p.solved() for p in pool[start:start + args.batch_size]], progress=False,
                    learning_rate=args.learning_rate, lr_schedule="constant", assistant_turns="last")
                trained_seconds += time.perf_counter() - began
                steps += 1
                losses.extend(m.loss for m in result.metrics)
            scores = await greedy_and_sampled(server.base_url, KEY, model.name, eval_set)
            loss = sum(losses) / len(losses) if losses else float("nan")
            passes.append({"pass": epoch, "steps": steps, "train_seconds": round(trained_seconds, 1),
                           "loss": loss, **scores})
            print(f"{epoch:>4} {steps:>5} {trained_seconds:>8.0f} {loss:>7.4f} {scores['greedy']:>7.1%} "
                  f"{scores['sampled']:>6.1%} {scores['greedy_task']:>11.1%}")
            if out_of_time:
                break
        await model.aclose()
    ceiling = max([p["greedy"] for p in passes], default=before["greedy"])
    print(f"ceiling (best held-out greedy accuracy): {ceiling:.1%}, from {before['greedy']:.1%} before training")
    return {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "before": before, "passes": passes, "ceiling_greedy": ceiling,
            "ceiling_greedy_task": max(p["greedy_task"] for p in [before, *passes]), "machine": machine()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-minutes", type=float, default=15.0, help="training time (evaluations not counted)")
    parser.add_argument("--epochs", type=int, default=6, help="passes over the pool at most")
    parser.add_argument("--model", help="a Hugging Face model directory to serve and train (default: the embedded "
                                        "SmolLM2-135M-Instruct)")
    parser.add_argument("--pool-size", type=int, default=1024, help="training problems (the demo's seed)")
    parser.add_argument("--eval-size", type=int, default=200, help="held-out problems (the demo's)")
    parser.add_argument("--batch-size", type=int, default=32, help="examples per training step")
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    report = asyncio.run(run(args))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
