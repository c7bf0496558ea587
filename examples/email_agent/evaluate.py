"""Score any model behind any OpenAI-compatible endpoint on the email questions (plain `openai`, no artlike).

    python -m examples.email_agent.evaluate --base-url http://127.0.0.1:8000/v1 \\
        --model HuggingFaceTB/SmolLM2-135M-Instruct --split test --limit 50
    python -m examples.email_agent.evaluate --base-url https://api.openai.com/v1 --model gpt-4o-mini \\
        --api-key $OPENAI_API_KEY                   # a prompted baseline

Greedy decoding (temperature 0) by default. The endpoint must support OpenAI tool calling (for vLLM:
`--enable-auto-tool-choice --tool-call-parser hermes` or artlike's `--tool-call-parser hermes`).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import random
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import openai
import orjson
from tqdm import tqdm

from examples.email_agent.agent import DEFAULT_MAX_TOKENS, DEFAULT_MAX_TURNS, grade_result, run_agent
from examples.email_agent.data import (
    DEFAULT_DATA_DIR,
    DEFAULT_INBOXES,
    DEFAULT_SEED,
    MAX_INBOXES,
    Corpus,
    EmailData,
    iter_questions,
    load_or_build,
)
from examples.email_agent.judge import LLMJudge
from examples.email_agent.records import Question, QuestionKind, Split
from examples.email_agent.reward import AsyncJudge
from examples.email_agent.tools import EmailTools


@dataclass(frozen=True)
class Episode:
    question_id: str
    kind: str
    reference: str
    final_answer: str | None
    sources: tuple[str, ...]
    reward: float
    metrics: dict[str, float]
    messages: list[dict[str, Any]] = field(repr=False)
    error: str | None = None  # the API error that ended the episode, if one did


@dataclass(frozen=True)
class EvalSummary:
    model: str
    questions: int
    errors: int
    answer_accuracy: float
    source_accuracy: float
    answer_rate: float  # returned any final answer ("I don't know" included)
    dont_know_rate: float
    wrong_rate: float
    mean_turns: float
    invalid_tool_call_rate: float  # invalid tool calls / attempted tool calls, pooled over episodes
    mean_reward: float
    accuracy_by_kind: dict[str, float]


@dataclass(frozen=True)
class PairedDifference:
    """after − before of a per-question score, with a bootstrap 95% interval over questions."""

    before: float
    after: float
    difference: float
    low: float
    high: float
    questions: int

    def __str__(self) -> str:
        return (f"{self.before:.1%} -> {self.after:.1%}: {self.difference:+.1%} "
                f"(95% CI {self.low:+.1%} .. {self.high:+.1%}, {self.questions} questions)")


def paired_bootstrap(before: Sequence[float], after: Sequence[float], *, resamples: int = 10_000,
                     seed: int = 0) -> PairedDifference:
    """Resample questions with replacement (the same ones for both columns, so each question is its own
    control) and take the 2.5th and 97.5th percentiles of the mean difference.

    >>> d = paired_bootstrap([0, 0, 0, 1] * 16, [1, 1, 0, 1] * 16)
    >>> round(d.difference, 3), d.low > 0
    (0.5, True)
    """
    if len(before) != len(after) or not before:
        raise ValueError(f"need the same questions before and after, got {len(before)} and {len(after)}")
    rng = random.Random(seed)
    deltas = [b - a for a, b in zip(before, after, strict=True)]
    n = len(deltas)
    means = sorted(sum(deltas[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    return PairedDifference(before=statistics.fmean(before), after=statistics.fmean(after),
                            difference=statistics.fmean(deltas), low=means[int(0.025 * resamples)],
                            high=means[int(0.975 * resamples) - 1], questions=n)


def accuracy_difference(before: Sequence[Episode], after: Sequence[Episode]) -> PairedDifference:
    """Answer accuracy after − before over the questions both evaluations answered without an API error."""
    by_question = {e.question_id: e for e in before if e.error is None}
    pairs = [(by_question[e.question_id], e) for e in after if e.error is None and e.question_id in by_question]
    return paired_bootstrap([b.metrics["answer_correct"] for b, _ in pairs], [a.metrics["answer_correct"] for _, a in pairs])


def select_questions(
    corpus: Corpus, split: Split, limit: int | None = None, kinds: tuple[QuestionKind, ...] | None = None
) -> list[Question]:
    """A fixed pseudo-random order (by a hash of the id), so `--limit 20` is a prefix of `--limit 50`."""
    questions = iter_questions(corpus, split, kinds)
    ordered = sorted(questions, key=lambda q: hashlib.sha256(q.id.encode()).hexdigest())
    return ordered if limit is None else ordered[:limit]


async def evaluate(
    client: openai.AsyncOpenAI,
    model: str,
    questions: Sequence[Question],
    db_path: Path,
    *,
    concurrency: int = 8,
    max_turns: int = DEFAULT_MAX_TURNS,
    temperature: float = 0.0,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    judge: AsyncJudge | None = None,
    progress: bool = True,
    tool_choice: str | None = None,
) -> list[Episode]:
    """One episode per question, `concurrency` at a time. An API error ends only its own episode."""
    semaphore = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(questions), desc=f"eval {model}", disable=not progress, leave=False)

    async def one(question: Question) -> Episode:
        async with semaphore:
            with EmailTools(db_path, question.inbox) as tools:
                try:
                    result = await run_agent(client, model, question, tools, max_turns=max_turns,
                                             temperature=temperature, max_tokens=max_tokens,
                                             tool_choice=tool_choice)
                except openai.APIError as error:
                    bar.update()
                    return Episode(question.id, question.kind, question.answer, None, (), 0.0, {}, [],
                                   error=f"{type(error).__name__}: {error}")
            breakdown = await grade_result(question, result, max_turns, judge)
            bar.update()
            return Episode(question.id, question.kind, question.answer, result.final_answer, result.sources,
                           breakdown.total, {**result.metrics(), **breakdown.metrics()}, result.messages)

    try:
        return list(await asyncio.gather(*(one(q) for q in questions)))
    finally:
        bar.close()


def summarise(model: str, episodes: Sequence[Episode]) -> EvalSummary:
    done = [e for e in episodes if e.error is None]

    def mean(metric: str) -> float:
        return statistics.fmean(e.metrics[metric] for e in done) if done else float("nan")

    attempted = sum(e.metrics["tool_calls"] + e.metrics["unparsed_tool_calls"] + e.metrics["text_replies"]
                    for e in done)
    kinds = sorted({e.kind for e in done})
    return EvalSummary(
        model=model,
        questions=len(episodes),
        errors=len(episodes) - len(done),
        answer_accuracy=mean("answer_correct"),
        source_accuracy=mean("sources_correct"),
        answer_rate=mean("answered"),
        dont_know_rate=mean("answer_dont_know"),
        wrong_rate=mean("answer_wrong"),
        mean_turns=mean("turns"),
        invalid_tool_call_rate=sum(e.metrics["invalid_tool_calls"] for e in done) / attempted if attempted else 0.0,
        mean_reward=statistics.fmean(e.reward for e in done) if done else float("nan"),
        accuracy_by_kind={k: statistics.fmean(e.metrics["answer_correct"] for e in done if e.kind == k) for k in kinds},
    )


_ROWS: tuple[tuple[str, str, str], ...] = (
    ("answer accuracy", "answer_accuracy", "{:.1%}"),
    ("source accuracy", "source_accuracy", "{:.1%}"),
    ("answer rate (any final answer)", "answer_rate", "{:.1%}"),
    ('"I don\'t know"', "dont_know_rate", "{:.1%}"),
    ("wrong answers", "wrong_rate", "{:.1%}"),
    ("mean turns", "mean_turns", "{:.2f}"),
    ("invalid tool-call rate", "invalid_tool_call_rate", "{:.1%}"),
    ("mean reward", "mean_reward", "{:+.3f}"),
    ("questions (API errors)", "questions", "{}"),
)


def format_table(columns: Mapping[str, EvalSummary]) -> str:
    """A plain-text table: one row per metric, one column per evaluated model (e.g. before / after)."""
    header = ["metric", *columns]
    rows = [header]
    for label, attribute, fmt in _ROWS:
        cells = []
        for summary in columns.values():
            value = fmt.format(getattr(summary, attribute))
            cells.append(f"{value} ({summary.errors})" if attribute == "questions" else value)
        rows.append([label, *cells])
    for kind in sorted({k for s in columns.values() for k in s.accuracy_by_kind}):
        rows.append([f"  accuracy: {kind} questions",
                     *(f"{s.accuracy_by_kind[kind]:.1%}" if kind in s.accuracy_by_kind else "-" for s in columns.values())])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def add_corpus_arguments(parser: argparse.ArgumentParser, *, seed_help: str) -> None:
    """--seed, --inboxes and --data-dir: which generated corpus, and where its database is cached."""
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help=seed_help)
    parser.add_argument("--inboxes", type=int, default=DEFAULT_INBOXES, choices=range(1, MAX_INBOXES + 1), metavar="N",
                        help=f"inboxes in the generated corpus (1-{MAX_INBOXES}); each adds its own questions, so 8 "
                             f"inboxes give about twice the test questions of each kind that the default "
                             f"{DEFAULT_INBOXES} give")
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)


def corpus_from_arguments(args: argparse.Namespace) -> EmailData:
    return load_or_build(args.data_dir, args.seed, inboxes=args.inboxes)


def add_judge_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--judge-model", help="also accept answers an LLM judge calls correct (rules first)")
    parser.add_argument("--judge-base-url", help="OpenAI-compatible endpoint of the judge (default: OpenAI)")
    parser.add_argument("--judge-api-key", default=None, help="default: $OPENAI_API_KEY")


def judge_from_arguments(args: argparse.Namespace) -> AsyncJudge | None:
    if not args.judge_model:
        return None
    client = openai.AsyncOpenAI(base_url=args.judge_base_url, api_key=args.judge_api_key or os.environ.get("OPENAI_API_KEY"))
    return LLMJudge(client, args.judge_model)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m examples.email_agent.evaluate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"))
    parser.add_argument("--model", required=True, help="any model name the endpoint serves")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "EMPTY"))
    parser.add_argument("--split", choices=("train", "val", "test"), default="test")
    parser.add_argument("--limit", type=int, default=None, help="evaluate this many questions of the split")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-turns", type=int, default=DEFAULT_MAX_TURNS)
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="per model turn")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--tool-choice", choices=("auto", "required"), default="auto",
                        help="required: every reply is a valid tool call (the server's structured output)")
    add_corpus_arguments(parser, seed_help="corpus seed")
    parser.add_argument("--output", type=Path, help="write the summary and every episode (with messages) as JSON")
    add_judge_arguments(parser)
    return parser.parse_args(argv)


async def _main(args: argparse.Namespace) -> int:
    data = corpus_from_arguments(args)
    questions = select_questions(data.corpus, args.split, args.limit)
    client = openai.AsyncOpenAI(base_url=args.base_url, api_key=args.api_key)
    episodes = await evaluate(client, args.model, questions, data.db_path, concurrency=args.concurrency,
                              max_turns=args.max_turns, temperature=args.temperature, max_tokens=args.max_tokens,
                              judge=judge_from_arguments(args),
                              tool_choice=None if args.tool_choice == "auto" else args.tool_choice)
    summary = summarise(args.model, episodes)
    print(format_table({args.model: summary}))
    for episode in episodes:
        if episode.error is not None:
            print(f"first API error ({summary.errors} in all): {episode.error}", file=sys.stderr)
            break
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_bytes(orjson.dumps({"summary": asdict(summary), "episodes": [asdict(e) for e in episodes]},
                                             option=orjson.OPT_INDENT_2))
    return 1 if summary.errors == summary.questions else 0


def main(argv: Sequence[str] | None = None) -> int:
    return asyncio.run(_main(_parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
