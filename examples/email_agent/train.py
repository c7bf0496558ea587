"""Train the email agent with GRPO on an artlike server: baseline eval, RL steps, eval, a before/after table.

    python -m examples.email_agent.train --start-server       # launches `artlike serve` (default 135M model)
    python -m examples.email_agent.train --server http://127.0.0.1:8000          # a server already running

Each step samples `--questions-per-step` training questions, rolls each out `--group-size` times (a GRPO
group), and trains one step on the groups; the server swaps the new adapter in, so the next step's
rollouts already use it. Evaluation runs the same agent greedily on the test split through the plain
OpenAI endpoint (`name@step`, not recorded). Results go to stdout and to a JSON file.

The server must parse tool calls, which `artlike serve` does by default (for the default model: the
tool-chatml template with the hermes parser; --start-server runs it). For a larger model on a GPU, see README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

import openai
import orjson

import artlike as art
from examples.email_agent.agent import DEFAULT_MAX_TOKENS, DEFAULT_MAX_TURNS
from examples.email_agent.data import DEFAULT_DATA_DIR, DEFAULT_SEED, iter_questions, load_or_build
from examples.email_agent.evaluate import (
    EvalSummary,
    add_judge_arguments,
    evaluate,
    format_table,
    judge_from_arguments,
    select_questions,
    summarise,
)
from examples.email_agent.records import Question, QuestionKind
from examples.email_agent.rollout import rollout

DEFAULT_BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
SERVE_ARGUMENTS: tuple[str, ...] = ()  # tool calling is on by default


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m examples.email_agent.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    server = parser.add_argument_group("server")
    server.add_argument("--server", default="http://127.0.0.1:8000", help="artlike server URL")
    server.add_argument("--start-server", action="store_true",
                        help=f"launch `artlike serve {' '.join(SERVE_ARGUMENTS)}` on --server's host and port")
    server.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                        help="extra argument for `artlike serve` (repeatable), e.g. --serve-arg=--data-dir=/tmp/a")
    server.add_argument("--server-data-dir", type=Path, default=Path("~/.artlike"),
                        help="with --start-server: the server's data dir (adapters, completion log, server.log)")
    server.add_argument("--server-timeout", type=float, default=900.0, help="seconds to wait for it to be ready")
    model = parser.add_argument_group("model")
    model.add_argument("--name", default="email-agent", help="trainable model name (an existing one resumes)")
    model.add_argument("--base-model", default=DEFAULT_BASE_MODEL, help="the base model the server serves")
    model.add_argument("--lora-rank", type=int, default=8)
    training = parser.add_argument_group("training")
    training.add_argument("--steps", type=int, default=10)
    training.add_argument("--questions-per-step", type=int, default=4)
    training.add_argument("--group-size", type=int, default=4, help="rollouts per question (GRPO group)")
    training.add_argument("--learning-rate", type=float, default=5e-5)
    # 0.7, not 1.0: at 1.0 the 135M model wrote a parseable first tool call 12 times in 32, at 0.7 25 times.
    training.add_argument("--temperature", type=float, default=0.7, help="rollout sampling temperature")
    training.add_argument("--kinds", default="subject,body,thread", help="question kinds to train on")
    training.add_argument("--max-exceptions", type=float, default=0.1, help="fraction of rollouts allowed to fail")
    agent = parser.add_argument_group("agent and evaluation")
    agent.add_argument("--max-turns", type=int, default=DEFAULT_MAX_TURNS)
    agent.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="per model turn")
    agent.add_argument("--eval-limit", type=int, default=40, help="test questions to evaluate (0: skip eval)")
    agent.add_argument("--eval-kinds", default=None,
                       help="question kinds to evaluate on (default: the --kinds trained on)")
    agent.add_argument("--eval-concurrency", type=int, default=8)
    agent.add_argument("--seed", type=int, default=DEFAULT_SEED, help="corpus and question-order seed")
    agent.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)
    agent.add_argument("--output", type=Path, help="results JSON (default: DATA_DIR/results-NAME.json)")
    add_judge_arguments(parser)
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------------------- server


@asynccontextmanager
async def served(args: argparse.Namespace) -> AsyncIterator[None]:
    """`artlike serve` as a child process for the duration of the block, when --start-server is given."""
    if not args.start_server:
        yield
        return
    from artlike_server.launcher import ServerProcess  # the server package, needed only to start one

    url = urlsplit(args.server)
    if url.hostname not in ("127.0.0.1", "localhost"):
        raise SystemExit(f"--start-server starts a local server; --server must be http://127.0.0.1:PORT, not {args.server}")
    server = ServerProcess(args.server_data_dir.expanduser(), args=[*SERVE_ARGUMENTS, *args.serve_arg],
                           api_key=os.environ.get("ARTLIKE_API_KEY"), port=url.port or 8000,
                           start_timeout_s=args.server_timeout)
    print(f"starting artlike serve {' '.join(server.args)} on port {server.port} (log: {server.log_path})", flush=True)
    await asyncio.to_thread(server.start)  # returns once /health says the engine is ready
    try:
        yield
    finally:
        await asyncio.to_thread(server.stop)


# -------------------------------------------------------------------------------------------- train


def _batches(questions: list[Question], size: int, seed: int) -> Iterator[list[Question]]:
    """Endless batches: every question once per epoch, in a seeded order."""
    rng = random.Random(seed)
    while True:
        order = list(questions)
        rng.shuffle(order)
        for start in range(0, len(order) - size + 1, size):
            yield order[start:start + size]


def _kinds(comma_separated: str) -> tuple[QuestionKind, ...]:
    return tuple(cast(QuestionKind, k.strip()) for k in comma_separated.split(",") if k.strip())


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Baseline eval, `--steps` GRPO steps, final eval; returns everything for the results JSON."""
    data = load_or_build(args.data_dir, args.seed)
    kinds = _kinds(args.kinds)
    train_questions = list(iter_questions(data.corpus, "train", kinds))
    if len(train_questions) < args.questions_per_step:
        raise SystemExit(f"only {len(train_questions)} training questions of kinds {sorted(kinds)}")
    eval_kinds = _kinds(args.eval_kinds or args.kinds)
    test_questions = select_questions(data.corpus, "test", args.eval_limit, eval_kinds) if args.eval_limit else []
    judge = judge_from_arguments(args)
    summaries: dict[str, EvalSummary] = {}
    history: list[dict[str, Any]] = []

    async with (
        served(args),
        art.TrainableModel(args.name, args.base_model, args.server, lora={"rank": args.lora_rank}) as model,
        # Evaluation goes through the plain OpenAI URL (`name@step`): served, not recorded.
        openai.AsyncOpenAI(base_url=model.inference_base_url,
                           api_key=os.environ.get("ARTLIKE_API_KEY") or "artlike") as client,
    ):
        step = first_step = (await model.register()).latest_step
        if first_step:
            print(f"{model.name} exists at step {first_step}: training resumes from there", flush=True)

        async def evaluate_step(label: str) -> None:
            if test_questions:
                episodes = await evaluate(client, f"{model.name}@{step}", test_questions, data.db_path,
                                          concurrency=args.eval_concurrency, max_turns=args.max_turns,
                                          max_tokens=args.max_tokens, judge=judge)
                summaries[f"{label} ({model.name}@{step})"] = summarise(f"{model.name}@{step}", episodes)
                print("\n" + format_table(summaries), flush=True)

        await evaluate_step("before")
        batches = _batches(train_questions, args.questions_per_step, args.seed)
        for _ in range(args.steps):
            started = time.monotonic()
            groups = await art.gather_trajectory_groups(
                (art.TrajectoryGroup(
                    rollout(model, q, data.db_path, max_turns=args.max_turns, temperature=args.temperature,
                            max_tokens=args.max_tokens, judge=judge) for _ in range(args.group_size))
                 for q in next(batches)),
                max_exceptions=args.max_exceptions)
            rollout_seconds = time.monotonic() - started
            result = await model.train(groups, learning_rate=args.learning_rate)
            step = result.step
            history.append(_step_record(groups, result, rollout_seconds, time.monotonic() - started - rollout_seconds))
            print(_format_step(history[-1]), flush=True)
        await evaluate_step("after")

    return {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "model": args.name, "first_step": first_step, "last_step": step, "steps": history,
            "evaluations": {label: asdict(s) for label, s in summaries.items()}}


def _step_record(groups: list[art.TrajectoryGroup], result: art.TrainResult, rollout_seconds: float,
                 train_seconds: float) -> dict[str, Any]:
    trajectories = [t for g in groups for t in g]
    metric_names = sorted({name for t in trajectories for name in t.metrics})
    return {
        "step": result.step,
        "trained": result.trained,
        "reason": result.done.reason,
        "trajectories": len(trajectories),
        "failed_rollouts": sum(len(g.exceptions) for g in groups),
        "groups_skipped": result.start.groups_skipped if result.start else None,
        # multi-turn trajectories whose turns extend each other token-exactly train as one sequence each
        "sequences": result.start.sequences if result.start else None,
        "trainable_tokens": result.start.trainable_tokens if result.start else None,
        "reward": _mean([t.reward for t in trajectories if t.reward is not None]),
        "metrics": {name: _mean([t.metrics[name] for t in trajectories if name in t.metrics]) for name in metric_names},
        "loss": _mean([m.loss for m in result.metrics]),
        "rollout_seconds": rollout_seconds,
        "train_seconds": train_seconds,
    }


def _format_step(record: dict[str, Any]) -> str:
    m = record["metrics"]
    trained = "" if record["trained"] else f"  NOT TRAINED: {record['reason']}"
    return (f"step {record['step']}: reward {record['reward']:+.3f}  correct {m.get('answer_correct', 0):.0%}  "
            f"answered {m.get('answered', 0):.0%}  invalid calls {m.get('invalid_tool_call_rate', 0):.0%}  "
            f"turns {m.get('turns', 0):.2f}  groups skipped {record['groups_skipped']}  "
            f"rollouts {record['rollout_seconds']:.0f}s train {record['train_seconds']:.0f}s{trained}")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    results = asyncio.run(run(args))
    output = args.output or args.data_dir / f"results-{args.name}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))
    print(f"results: {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
