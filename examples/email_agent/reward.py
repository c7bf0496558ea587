"""Grading an agent's final answer: a pure function from (question, answer, sources, stats) to a reward.

Reward table (defaults of `RewardWeights`; every component is logged as a trajectory metric `reward/<name>`):

    component  when                                                       value
    ---------  ---------------------------------------------------------  -----------------------------------
    answer     correct (normalised match, or the judge accepts it)         +1.0
               "I don't know"                                              0.0
               no final answer (turn limit, or never called the tool)    -0.75
               wrong                                                      -1.0
    sources    F1 of the cited message ids against the question's sources +0.2 × F1 (0 without an answer)
    found      share of the source emails that appeared in search results +0.1 × share
    read       share of the source emails opened with read_email          +0.1 × share
    turns      correct answers only: fewer model turns is better          +0.1 × (max_turns − turns) / (max_turns − 1)
    invalid    each invalid tool call (bad JSON/arguments, unknown tool,  −0.2 each, at most −0.5 in all
               a tool call written as text, a reply with no tool call)

The bands never overlap, so whatever the partial credit: wrong (−1.5…−0.6) < "I don't know" (−0.5…0.4)
< correct (0.5…1.5), and no answer (−1.25…−0.55) never beats "I don't know". The turn bonus is for
correct answers only, otherwise answering "I don't know" at once would be rewarded for speed.

Why these numbers: a hallucinated answer is the worst outcome for a user, so a wrong answer is below
running out of turns. But a run that degenerates into malformed tool calls must score below a clean
run that answers wrongly (−1.25 vs −0.9 typically), or RL would teach a weak model to stop calling tools
properly; hence the invalid-call penalty is large. Small models start with most tool calls invalid, so
this component carries most of the early learning signal.

Answer matching (`match_answer`). Both sides are normalised: lower case; dates to one form ("Thursday,
March 14", "Mar 14th", "14 March 2024", "2024-03-14" and "3/14" are all March 14, year ignored); times to
24-hour form ("3:30 PM", "3:30pm", "15:30" agree; "3 PM" is 15:00); currency markers dropped and numbers
unformatted ("$1,200.00", "1200 dollars", "USD 1,200" and "1,200" are all 1200); punctuation to spaces;
articles dropped. A match is `exact` (verbatim, case-insensitive), `normalised` (equal after normalising,
or equal to an alias), or `contains` (the reference's words appear in order inside a short answer: at most
`CONTAINS_MAX_EXTRA_WORDS` words more and no second date or time of the kind asked for, so a sentence around the fact is fine but
a list of guesses is not).
Anything else is wrong unless the optional judge accepts it; the judge is asked only then.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from decimal import Decimal
from enum import StrEnum

from examples.email_agent.records import Question

CONTAINS_MAX_EXTRA_WORDS = 8

Judge = Callable[[Question, str], bool]
"""Accepts or rejects an answer the rules call wrong (an LLM judge, a human, a lookup table)."""
AsyncJudge = Callable[[Question, str], Awaitable[bool]]


class Verdict(StrEnum):
    CORRECT = "correct"
    DONT_KNOW = "dont_know"
    MISSING = "missing"
    WRONG = "wrong"


class Match(StrEnum):
    EXACT = "exact"
    NORMALISED = "normalised"
    CONTAINS = "contains"
    JUDGE = "judge"
    NONE = "none"


@dataclass(frozen=True)
class RewardWeights:
    correct: float = 1.0
    dont_know: float = 0.0
    missing: float = -0.75
    wrong: float = -1.0
    sources: float = 0.2
    found: float = 0.1
    read: float = 0.1
    turns: float = 0.1
    invalid_call: float = -0.2
    invalid_floor: float = -0.5


DEFAULT_WEIGHTS = RewardWeights()


@dataclass(frozen=True)
class TrajectoryStats:
    """What the agent did, as far as the reward cares."""

    turns: int  # model calls
    max_turns: int
    invalid_tool_calls: int = 0
    emails_found: frozenset[str] = field(default_factory=frozenset)  # ids shown in search results
    emails_read: frozenset[str] = field(default_factory=frozenset)  # ids opened with read_email


@dataclass(frozen=True)
class RewardBreakdown:
    verdict: Verdict
    match: Match
    answer: float
    sources: float
    found: float
    read: float
    turns: float
    invalid: float
    source_precision: float
    source_recall: float

    @property
    def total(self) -> float:
        return self.answer + self.sources + self.found + self.read + self.turns + self.invalid

    @property
    def sources_correct(self) -> bool:
        """At least one true source cited and nothing else."""
        return self.source_precision == 1.0 and self.source_recall > 0.0

    def metrics(self) -> dict[str, float]:
        return {
            "reward/answer": self.answer,
            "reward/sources": self.sources,
            "reward/found": self.found,
            "reward/read": self.read,
            "reward/turns": self.turns,
            "reward/invalid": self.invalid,
            "answer_correct": float(self.verdict is Verdict.CORRECT),
            "answer_wrong": float(self.verdict is Verdict.WRONG),
            "answer_dont_know": float(self.verdict is Verdict.DONT_KNOW),
            "answer_missing": float(self.verdict is Verdict.MISSING),
            "answer_judged": float(self.match is Match.JUDGE),
            "sources_correct": float(self.sources_correct),
            "source_precision": self.source_precision,
            "source_recall": self.source_recall,
        }


# ---------------------------------------------------------------------------------------- normalising

_MONTHS = {m: i for i, m in enumerate(
    ("january", "february", "march", "april", "may", "june", "july", "august", "september", "october",
     "november", "december"), start=1)}
_MONTH = r"(jan(?:uary)?|feb(?:ruary)?|mar(?:ch)?|apr(?:il)?|may|june?|july?|aug(?:ust)?|sep(?:t(?:ember)?)?|oct(?:ober)?|nov(?:ember)?|dec(?:ember)?)\.?"
_WEEKDAY = r"(?:(?:mon|tues?|wed(?:nes)?|thu(?:rs)?|fri|sat(?:ur)?|sun)(?:day)?\.?,?\s+)?"
_ORDINAL = r"(?:st|nd|rd|th)?"
_YEAR = r"(?:,?\s+\d{4})?"
_DATE_PATTERNS = (
    (re.compile(rf"\b{_WEEKDAY}{_MONTH}\s+(\d{{1,2}}){_ORDINAL}{_YEAR}\b"), "month_day"),
    (re.compile(rf"\b{_WEEKDAY}(\d{{1,2}}){_ORDINAL}\s+(?:of\s+)?{_MONTH}{_YEAR}\b"), "day_month"),
    (re.compile(r"\b\d{4}-(\d{1,2})-(\d{1,2})\b"), "iso"),
    (re.compile(r"\b(\d{1,2})/(\d{1,2})(?:/\d{2,4})?\b"), "us"),
)
_TIME_12H = re.compile(r"\b(\d{1,2})(?::(\d{2}))?\s*([ap])\.?\s?m\b\.?")
_TIME_24H = re.compile(r"\b([01]?\d|2[0-3]):([0-5]\d)\b")
_CURRENCY = re.compile(r"\$|\busd\b|\bdollars?\b")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")
_DECIMAL = re.compile(r"\b\d+\.\d+\b")
_NON_WORD = re.compile(r"[\W_]+")
_ARTICLES = frozenset({"a", "an", "the"})


def _month_number(name: str) -> int:
    return next(number for month, number in _MONTHS.items() if month.startswith(name[:3]))


def _date_token(match: re.Match[str], form: str) -> str:
    if form == "month_day":
        month, day = _month_number(match.group(1)), int(match.group(2))
    elif form == "day_month":
        month, day = _month_number(match.group(2)), int(match.group(1))
    else:
        month, day = int(match.group(1)), int(match.group(2))
    if not (1 <= month <= 12 and 1 <= day <= 31):
        return match.group(0)
    return f" date{month:02d}{day:02d} "


def _time_token(hour: int, minute: int, half: str | None) -> str:
    if half is not None:
        if not 1 <= hour <= 12:
            return ""
        hour = hour % 12 + (12 if half == "p" else 0)
    return f" time{hour:02d}{minute:02d} "


def normalise(text: str) -> str:
    """Canonical word sequence of an answer; see the module docstring for the rules."""
    text = unicodedata.normalize("NFKC", text).lower().strip()
    text = re.sub(r"\bnoon\b", "12:00 pm", text)
    text = _TIME_12H.sub(lambda m: _time_token(int(m.group(1)), int(m.group(2) or 0), m.group(3)) or m.group(0), text)
    text = _TIME_24H.sub(lambda m: _time_token(int(m.group(1)), int(m.group(2)), None), text)
    for pattern, form in _DATE_PATTERNS:
        text = pattern.sub(functools.partial(_date_token, form=form), text)
    text = _CURRENCY.sub(" ", text)
    text = _THOUSANDS.sub("", text)
    text = _DECIMAL.sub(lambda m: f"{Decimal(m.group(0)).normalize():f}", text)  # 1200.00 -> 1200, 7.50 -> 7.5
    words = [w for w in _NON_WORD.sub(" ", text).split() if w not in _ARTICLES]
    return " ".join(words)


_DONT_KNOW = re.compile(
    r"^(?:i\s+(?:do\s*n[o']?t|don'?t|dont)\s+know|i\s+(?:could|can)\s*(?:no|n'|')?t\s+find|idk|unknown|not\s+found"
    r"|no\s+(?:answer|information)|i\s+am\s+not\s+sure|i'?m\s+not\s+sure)\b"
)


def is_dont_know(answer: str) -> bool:
    return _DONT_KNOW.match(unicodedata.normalize("NFKC", answer).lower().strip().replace("’", "'")) is not None


def match_answer(question: Question, answer: str) -> Match:
    """How `answer` matches the reference (or an alias), by the rules alone: never Match.JUDGE."""
    references = (question.answer, *question.answer_aliases)
    if any(answer.strip().lower() == r.strip().lower() for r in references):
        return Match.EXACT
    given = normalise(answer)
    normalised = [normalise(r) for r in references]
    if given and given in normalised:
        return Match.NORMALISED
    given_words = given.split()
    for reference in normalised:
        ref_words = reference.split()
        if (ref_words and len(given_words) - len(ref_words) <= CONTAINS_MAX_EXTRA_WORDS
                and _contains(given_words, ref_words) and not _other_dates_or_times(given_words, ref_words)):
            return Match.CONTAINS
    return Match.NONE


def _contains(words: list[str], part: list[str]) -> bool:
    return any(words[i:i + len(part)] == part for i in range(len(words) - len(part) + 1))


def _other_dates_or_times(words: list[str], reference: list[str]) -> bool:
    """A second time next to a reference time ("3:30 PM or 4 PM"), or a second date next to a reference date,
    hedges between guesses: not a containment. A date next to a reference time is just more detail."""
    kinds = {w[:4] for w in reference if _is_typed_token(w)}
    return any(_is_typed_token(w) and w[:4] in kinds and w not in reference for w in words)


def _is_typed_token(word: str) -> bool:
    return word.startswith(("date", "time")) and len(word) == 8 and word[4:].isdigit()


# -------------------------------------------------------------------------------------------- grading


def grade(
    question: Question,
    final_answer: str | None,
    sources: Iterable[str],
    stats: TrajectoryStats,
    judge: Judge | None = None,
    weights: RewardWeights = DEFAULT_WEIGHTS,
) -> RewardBreakdown:
    """The reward of one trajectory. `final_answer` is None when the agent never returned one."""
    verdict, match = _verdict(question, final_answer, judge)
    gold = set(question.source_ids)
    cited = set(sources) if verdict is not Verdict.MISSING else set()  # sources come with an answer
    hits = len(gold & cited)
    precision = hits / len(cited) if cited else 0.0
    recall = hits / len(gold)
    f1 = 2 * precision * recall / (precision + recall) if hits else 0.0
    answer_value = {
        Verdict.CORRECT: weights.correct, Verdict.DONT_KNOW: weights.dont_know,
        Verdict.MISSING: weights.missing, Verdict.WRONG: weights.wrong,
    }[verdict]
    turns_bonus = 0.0
    if verdict is Verdict.CORRECT and stats.max_turns > 1:
        turns_bonus = weights.turns * max(0, stats.max_turns - max(stats.turns, 1)) / (stats.max_turns - 1)
    return RewardBreakdown(
        verdict=verdict,
        match=match,
        answer=answer_value,
        sources=weights.sources * f1,
        found=weights.found * len(gold & stats.emails_found) / len(gold),
        read=weights.read * len(gold & stats.emails_read) / len(gold),
        turns=turns_bonus,
        invalid=max(weights.invalid_floor, weights.invalid_call * stats.invalid_tool_calls),
        source_precision=precision,
        source_recall=recall,
    )


def _verdict(question: Question, final_answer: str | None, judge: Judge | None) -> tuple[Verdict, Match]:
    if final_answer is None or not final_answer.strip():
        return Verdict.MISSING, Match.NONE
    if is_dont_know(final_answer):
        return Verdict.DONT_KNOW, Match.NONE
    match = match_answer(question, final_answer)
    if match is not Match.NONE:
        return Verdict.CORRECT, match
    if judge is not None and judge(question, final_answer):
        return Verdict.CORRECT, Match.JUDGE
    return Verdict.WRONG, Match.NONE


async def grade_with_async_judge(
    question: Question,
    final_answer: str | None,
    sources: Iterable[str],
    stats: TrajectoryStats,
    judge: AsyncJudge,
    weights: RewardWeights = DEFAULT_WEIGHTS,
) -> RewardBreakdown:
    """`grade` with an async judge (an LLM behind an API), awaited only for answers the rules call wrong."""
    accepted = False
    if (final_answer is not None and final_answer.strip() and not is_dont_know(final_answer)
            and match_answer(question, final_answer) is Match.NONE):
        accepted = await judge(question, final_answer)
    return grade(question, final_answer, sources, stats, judge=lambda _q, _a: accepted, weights=weights)
