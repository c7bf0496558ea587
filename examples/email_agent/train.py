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
from collections.abc import AsyncIterator, Awaitable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

import openai
import orjson

import artlike as art
from bench.machine import machine
from examples.email_agent.agent import DEFAULT_MAX_TOKENS, DEFAULT_MAX_TURNS
from examples.email_agent.data import iter_questions
from examples.email_agent.evaluate import (
    Episode,
    EvalSummary,
    accuracy_difference,
    add_corpus_arguments,
    add_judge_arguments,
    corpus_from_arguments,
    evaluate,
    format_table,
    judge_from_arguments,
    select_questions,
    summarise,
)
from examples.email_agent.records import Question, QuestionKind
from examples.email_agent.reward import DEFAULT_WEIGHTS, RewardWeights
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
    warm = parser.add_argument_group("warm start: SFT on the agent's own successful episodes (rejection sampling)")
    warm.add_argument("--warm-start-questions", type=int, default=0,
                      help="training questions to sample per warm-start round (0: no warm start)")
    warm.add_argument("--warm-start-rounds", type=int, default=1,
                      help="rounds of rejection sampling + SFT (expert iteration): each round samples fresh "
                           "questions from the policy the previous round trained, so successes grow more common")
    warm.add_argument("--warm-start-samples", type=int, default=4, help="episodes per warm-start question")
    warm.add_argument("--warm-start-kinds", default=None,
                      help="question kinds of the warm start (default: the first curriculum phase's)")
    warm.add_argument("--warm-start-temperature", type=float, default=0.7)
    warm.add_argument("--warm-start-concurrency", type=int, default=64,
                      help="warm-start episodes running at once: all at once, a thousand queued requests outwait "
                           "the client's timeout on a CPU engine and are sent again")
    warm.add_argument("--warm-start-min-reward", type=float, default=0.5,
                      help="keep each question's best episode when its reward reaches this (a correct answer)")
    warm.add_argument("--warm-start-top-k", type=int, default=1,
                      help="keep up to this many such episodes per question")
    warm.add_argument("--warm-start-epochs", type=int, default=2)
    warm.add_argument("--warm-start-learning-rate", type=float, default=1e-4)
    training = parser.add_argument_group("RL (GRPO through art.PipelineTrainer)")
    training.add_argument("--steps", type=int, default=10)
    training.add_argument("--train-minutes", type=float, default=None,
                          help="stop the RL phase after this many minutes (the step in progress finishes)")
    training.add_argument("--questions-per-step", type=int, default=4)
    training.add_argument("--group-size", type=int, default=4, help="rollouts per question (GRPO group)")
    training.add_argument("--learning-rate", type=float, default=5e-5)
    training.add_argument("--max-steps-off-policy", type=int, default=1,
                          help="0: the sequential loop; 1: the next step's rollouts sample while a step trains")
    # 0.7, not 1.0: at 1.0 the 135M model wrote a parseable first tool call 12 times in 32, at 0.7 25 times.
    training.add_argument("--temperature", type=float, default=0.7, help="rollout sampling temperature")
    training.add_argument("--kinds", default="subject,body,thread", help="question kinds to train on")
    training.add_argument("--curriculum", default=None, metavar="KINDS@STEPS,...",
                          help="phases of question kinds, easiest first, e.g. subject@6,subject+body@6 "
                               "(the last phase runs until the end; default: --kinds throughout)")
    training.add_argument("--reward-weight", action="append", default=[], metavar="NAME=VALUE",
                          help="override a weight of the training reward (repeatable; names as in reward.RewardWeights), "
                               "e.g. --reward-weight wrong=0 so that a wrong guess is no worse than \"I don't know\"; "
                               "evaluation keeps the default weights")
    training.add_argument("--max-exceptions", type=float, default=0.1, help="fraction of rollouts allowed to fail")
    training.add_argument("--ruler-model", default=None,
                          help="score each group relative to each other with this LLM judge (art.judge_group, "
                               "RULER-style) instead of the rule-based reward, which is kept as independent_reward")
    training.add_argument("--ruler-base-url", default=None,
                          help="the judge's OpenAI-compatible endpoint (default: this server's /v1)")
    training.add_argument("--ruler-api-key", default=None, help="default: $ARTLIKE_API_KEY or $OPENAI_API_KEY")
    agent = parser.add_argument_group("agent and evaluation")
    agent.add_argument("--max-turns", type=int, default=DEFAULT_MAX_TURNS)
    agent.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="per model turn")
    agent.add_argument("--tool-choice", choices=("auto", "required"), default="auto",
                       help="required: every reply is a valid call of one of the tools (the server's structured "
                            "output), in training and evaluation alike")
    agent.add_argument("--eval-limit", type=int, default=64, help="test questions to evaluate (0: skip eval)")
    agent.add_argument("--eval-kinds", default=None,
                       help="question kinds to evaluate on (default: the --kinds trained on)")
    agent.add_argument("--eval-concurrency", type=int, default=8)
    agent.add_argument("--output", type=Path, help="results JSON (default: DATA_DIR/results-NAME.json)")
    add_corpus_arguments(parser, seed_help="corpus and question-order seed")
    add_judge_arguments(parser)
    args = parser.parse_args(argv)
    try:
        args.weights = reward_weights(args.reward_weight)
    except ValueError as bad:
        parser.error(str(bad))
    return args


def reward_weights(overrides: Sequence[str]) -> RewardWeights:
    """The default weights with `NAME=VALUE` overrides.

    >>> reward_weights(["wrong=0", "dont_know=-0.1"]).wrong, reward_weights([]) == DEFAULT_WEIGHTS
    (0.0, True)
    >>> reward_weights(["wrongg=0"])
    Traceback (most recent call last):
    ValueError: --reward-weight wrongg=0: no such weight (correct, dont_know, missing, wrong, sources, found, read, turns, invalid_call, invalid_floor)
    """
    names = [f.name for f in fields(RewardWeights)]
    changes: dict[str, float] = {}
    for override in overrides:
        name, _, value = override.partition("=")
        if name.strip() not in names:
            raise ValueError(f"--reward-weight {override}: no such weight ({', '.join(names)})")
        try:
            changes[name.strip()] = float(value)
        except ValueError:
            raise ValueError(f"--reward-weight {override}: {value!r} is not a number") from None
    return replace(DEFAULT_WEIGHTS, **changes)


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


def _shuffled(questions: list[Question], rng: random.Random) -> Iterator[Question]:
    """Endless: every question once per epoch, in a seeded order."""
    while True:
        order = list(questions)
        rng.shuffle(order)
        yield from order


def curriculum(phases: Sequence[tuple[tuple[QuestionKind, ...], int | None]], questions: Sequence[Question],
               per_step: int, seed: int) -> Iterator[Question]:
    """Training questions phase by phase: `steps × per_step` questions of the phase's kinds (the last phase
    has no end). Each group is one question, so a phase of N steps is N × per_step groups.

    >>> import itertools
    >>> qs = [Question(id=f"{k}{i}", inbox="a", question="?", answer="x", answer_aliases=(), source_ids=("m",),
    ...                kind=k, split="train") for k in ("subject", "body") for i in range(3)]
    >>> [q.kind for q in itertools.islice(curriculum([(("subject",), 1), (("body",), None)], qs, 2, 0), 5)]
    ['subject', 'subject', 'body', 'body', 'body']
    """
    rng = random.Random(seed)
    for kinds, steps in phases:
        pool = [q for q in questions if q.kind in kinds]
        if not pool:
            raise SystemExit(f"no training questions of kinds {sorted(kinds)}")
        chosen = _shuffled(pool, rng)
        yield from (next(chosen) for _ in range(steps * per_step)) if steps is not None else chosen


def parse_curriculum(text: str | None, kinds: str) -> list[tuple[tuple[QuestionKind, ...], int | None]]:
    """ "subject@6,subject+body@6" -> [(("subject",), 6), (("subject", "body"), None)]: the last phase never ends."""
    if not text:
        return [(_kinds(kinds), None)]
    phases: list[tuple[tuple[QuestionKind, ...], int | None]] = []
    for part in text.split(","):
        names, _, steps = part.partition("@")
        phases.append((_kinds(names.replace("+", ",")), int(steps) if steps else None))
    return [*phases[:-1], (phases[-1][0], None)]


def _kinds(comma_separated: str) -> tuple[QuestionKind, ...]:
    return tuple(cast(QuestionKind, k.strip()) for k in comma_separated.split(",") if k.strip())


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


async def warm_start(model: art.TrainableModel, rounds: Sequence[Sequence[Question]], args: argparse.Namespace,
                     db_path: Path, judge: Any) -> list[dict[str, Any]]:
    """Expert iteration: each round rolls out its questions `--warm-start-samples` times with the latest
    policy, keeps each question's best episodes when they answered correctly, and fine-tunes on those
    episodes' exact sampled tokens (all turns); the next round samples from the policy this one trained."""
    records: list[dict[str, Any]] = []
    for number, questions in enumerate(rounds, start=1):
        records.append(await _warm_start_round(model, questions, args, db_path, judge, f"{number}/{len(rounds)}"))
    return records


async def _warm_start_round(model: art.TrainableModel, questions: Sequence[Question], args: argparse.Namespace,
                            db_path: Path, judge: Any, label: str) -> dict[str, Any]:
    started = time.monotonic()
    groups = await art.gather_trajectory_groups(
        (art.TrajectoryGroup(_rollout(model, q, db_path, args, judge, args.warm_start_temperature)
                             for _ in range(args.warm_start_samples)) for q in questions),
        max_exceptions=args.max_exceptions, min_group_size=1, pbar_desc=f"warm-start rollouts {label}",
        concurrency=args.warm_start_concurrency)
    episodes = [t for g in groups for t in g]
    chosen = art.best_of_groups(groups, top_k=args.warm_start_top_k, min_reward=args.warm_start_min_reward)
    solved = len(art.best_of_groups(groups, top_k=1, min_reward=args.warm_start_min_reward))  # one per solved question
    record: dict[str, Any] = {
        "questions": len(questions), "episodes": len(episodes), "solved_questions": solved, "kept": len(chosen),
        "sampled_accuracy": _mean([t.metrics.get("answer_correct", 0.0) for t in episodes]),
        "sampled_answer_rate": _mean([t.metrics.get("answered", 0.0) for t in episodes]),
        "sampled_invalid_tool_call_rate": _mean([t.metrics.get("invalid_tool_call_rate", 0.0) for t in episodes]),
        "rollout_seconds": time.monotonic() - started}
    print(f"warm start {label}: {solved} of {len(questions)} questions had a correct episode "
          f"(sampled accuracy {record['sampled_accuracy']:.1%}, answered {record['sampled_answer_rate']:.0%}, "
          f"invalid calls {record['sampled_invalid_tool_call_rate']:.0%}, {record['rollout_seconds']:.0f}s)", flush=True)
    if chosen:
        result = await model.train_sft(chosen, epochs=args.warm_start_epochs,
                                       learning_rate=args.warm_start_learning_rate, progress=False)
        record |= {"step": result.step, "sft_seconds": time.monotonic() - started - record["rollout_seconds"],
                   "loss": [m.loss for m in result.metrics]}
        print(f"warm start {label}: SFT on {len(chosen)} episodes -> step {result.step} "
              f"({record['sft_seconds']:.0f}s)", flush=True)
    return record


def warm_start_rounds(pool: Sequence[Question], per_round: int, rounds: int, seed: int) -> list[list[Question]]:
    """`rounds` batches of `per_round` questions, each question once before any repeats (a seeded order).

    >>> qs = [Question(id=str(i), inbox="a", question="?", answer="x", answer_aliases=(), source_ids=("m",),
    ...                kind="subject", split="train") for i in range(5)]
    >>> batches = warm_start_rounds(qs, 2, 2, seed=0)
    >>> [len(b) for b in batches], len({q.id for b in batches for q in b})
    ([2, 2], 4)
    """
    order = _shuffled(list(pool), random.Random(seed))
    return [[next(order) for _ in range(min(per_round, len(pool)))] for _ in range(rounds)]


def _ruler_judge(args: argparse.Namespace, server_v1: str) -> art.Judge | None:
    """The relative judge of `--ruler-model` (a failed judgement drops its group), or None."""
    if not args.ruler_model:
        return None
    api_key = args.ruler_api_key or os.environ.get("ARTLIKE_API_KEY") or os.environ.get("OPENAI_API_KEY") or "artlike"
    return art.Judge(model=args.ruler_model, base_url=args.ruler_base_url or server_v1, api_key=api_key,
                     max_tokens=1024, max_explanation_chars=200)


def _rollout(model: art.TrainableModel, question: Question, db_path: Path, args: argparse.Namespace, judge: Any,
             temperature: float) -> Awaitable[art.Trajectory]:
    """One recorded training episode with the command line's agent settings and training reward."""
    return rollout(model, question, db_path, max_turns=args.max_turns, temperature=temperature,
                   max_tokens=args.max_tokens, judge=judge, tool_choice=_tool_choice(args), weights=args.weights)


def _tool_choice(args: argparse.Namespace) -> str | None:
    return None if args.tool_choice == "auto" else args.tool_choice


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Baseline eval, optional warm start, RL steps through the pipeline, final eval; returns the results JSON."""
    data = corpus_from_arguments(args)
    phases = parse_curriculum(args.curriculum, args.kinds)
    trained_kinds = tuple(dict.fromkeys(k for kinds, _ in phases for k in kinds))
    train_questions = list(iter_questions(data.corpus, "train", trained_kinds))
    eval_kinds = _kinds(args.eval_kinds) if args.eval_kinds else trained_kinds
    test_questions = select_questions(data.corpus, "test", args.eval_limit, eval_kinds) if args.eval_limit else []
    judge = judge_from_arguments(args)
    summaries: dict[str, EvalSummary] = {}
    episodes: dict[str, list[Episode]] = {}
    started = time.monotonic()

    async with (
        served(args),
        art.TrainableModel(args.name, args.base_model, args.server, lora={"rank": args.lora_rank}) as model,
        # Evaluation goes through the plain OpenAI URL (`name@step`): served, not recorded.
        openai.AsyncOpenAI(base_url=model.inference_base_url,
                           api_key=os.environ.get("ARTLIKE_API_KEY") or "artlike") as client,
    ):
        first_step = (await model.register()).latest_step
        if first_step:
            print(f"{model.name} exists at step {first_step}: training resumes from there", flush=True)

        async def evaluate_step(label: str, step: int) -> None:
            if test_questions:
                found = await evaluate(client, f"{model.name}@{step}", test_questions, data.db_path,
                                       concurrency=args.eval_concurrency, max_turns=args.max_turns,
                                       max_tokens=args.max_tokens, judge=judge, tool_choice=_tool_choice(args))
                episodes[label] = found
                summaries[f"{label} ({model.name}@{step})"] = summarise(f"{model.name}@{step}", found)
                print("\n" + format_table(summaries), flush=True)

        await evaluate_step("before", first_step)
        warm = None
        if args.warm_start_questions:
            warm_kinds = _kinds(args.warm_start_kinds) if args.warm_start_kinds else phases[0][0]
            pool = list(iter_questions(data.corpus, "train", warm_kinds))
            rounds = warm_start_rounds(pool, args.warm_start_questions, args.warm_start_rounds, args.seed + 1)
            warm = await warm_start(model, rounds, args, data.db_path, judge)

        ruler = _ruler_judge(args, model.inference_base_url)
        trainer = art.PipelineTrainer(
            model,
            lambda q: _rollout(model, q, data.db_path, args, judge, args.temperature),
            curriculum(phases, train_questions, args.questions_per_step, args.seed),
            group_size=args.group_size, groups_per_step=args.questions_per_step,
            max_steps_off_policy=args.max_steps_off_policy, max_exceptions=args.max_exceptions,
            score_group=(lambda g: art.judge_group(g, ruler, swallow_exceptions=True)) if ruler else None,
            learning_rate=args.learning_rate, on_step=lambda s: print(_format_step(s), flush=True), progress=False)
        result = await trainer.run(num_steps=args.steps,
                                   max_seconds=args.train_minutes * 60 if args.train_minutes else None)
        await evaluate_step("after", result.final_step)

    difference = accuracy_difference(episodes["before"], episodes["after"]) if len(episodes) == 2 else None
    if difference is not None:
        print(f"answer accuracy {difference}", flush=True)
    print(f"wall time {(time.monotonic() - started) / 60:.1f} min; engine busy {result.engine_busy_fraction:.0%}, "
          f"trainer busy {result.trainer_busy_fraction:.0%} of the RL phase", flush=True)
    return {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "model": args.name, "first_step": first_step, "last_step": result.final_step, "warm_start": warm,
            "steps": [s.model_dump(mode="json") for s in result.steps],
            "accuracy_difference": asdict(difference) if difference is not None else None,
            "wall_seconds": time.monotonic() - started,
            "evaluations": {label: asdict(s) for label, s in summaries.items()},
            "machine": machine()}


def _format_step(step: art.PipelineStep) -> str:
    m = step.metrics
    trained = "" if step.trained else f"  NOT TRAINED: {step.reason}"
    return (f"step {step.step}: reward {step.reward_mean:+.3f}  correct {m.get('answer_correct', 0):.0%}  "
            f"answered {m.get('answered', 0):.0%}  invalid calls {m.get('invalid_tool_call_rate', 0):.0%}  "
            f"turns {m.get('turns', 0):.2f}  zero-variance groups {step.zero_variance_groups}/{step.groups}  "
            f"stale {step.staleness_mean:.2f}  rollouts {step.rollout_seconds:.0f}s train {step.train_seconds:.0f}s "
            f"step {step.step_seconds:.0f}s{trained}")


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
