"""The email agent's reward: worked examples for every component, answer normalisation, and the judge hook."""

from __future__ import annotations

import itertools

import pytest

from examples.email_agent.records import Question
from examples.email_agent.reward import (
    Match,
    RewardWeights,
    TrajectoryStats,
    Verdict,
    grade,
    grade_with_async_judge,
    is_dont_know,
    match_answer,
    normalise,
)

MEETING = Question("q1", "me@x.com", "What time is the Orion kickoff?", "3:30 PM", (), ("m1",), "subject", "test")
INVOICE = Question("q2", "me@x.com", "How much is the invoice from Northwind?", "$1,200.00", (), ("m2",), "body", "test")
DEADLINE = Question("q3", "me@x.com", "When is the Atlas design doc due?", "March 14", (), ("m3", "m4"), "thread", "test")
FLIGHT = Question("q4", "me@x.com", "What is my flight number to Denver?", "UA 482", ("UA482",), ("m5",), "subject", "test")

NOTHING_DONE = TrajectoryStats(turns=2, max_turns=5)


def _grade(question: Question, answer: str | None, sources: tuple[str, ...] = (), stats: TrajectoryStats = NOTHING_DONE) -> float:
    return grade(question, answer, sources, stats).total


# ------------------------------------------------------------------------------------ normalisation


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("$1,200.00", "1200"), ("1200 dollars", "1200"), ("USD 1,200", "1200"), ("1,200", "1200"),
        ("$7.50", "7 5"), ("7.5", "7 5"),
        ("Thursday, March 14", "date0314"), ("Mar 14th, 2024", "date0314"), ("14 March", "date0314"),
        ("2024-03-14", "date0314"), ("3/14", "date0314"),
        ("3:30 PM", "time1530"), ("3:30pm", "time1530"), ("15:30", "time1530"), ("3 p.m.", "time1500"),
        ("12 AM", "time0000"), ("noon", "time1200"),
        ("The Cedar room", "cedar room"), ("orion_design_doc_v3.pdf", "orion design doc v3 pdf"),
        ("(415) 555-0134", "415 555 0134"),
    ],
)
def test_normalise(text: str, expected: str) -> None:
    assert normalise(text) == expected


@pytest.mark.parametrize(
    ("question", "answer", "expected"),
    [
        (MEETING, "3:30 PM", Match.EXACT),
        (MEETING, "3:30 pm", Match.EXACT),
        (MEETING, "15:30", Match.NORMALISED),
        (MEETING, "The kickoff starts at 3:30pm.", Match.CONTAINS),
        (MEETING, "3:30 PM on Thursday, March 14", Match.CONTAINS),  # a date next to the time asked for is fine
        (MEETING, "3:30 PM or 4:00 PM", Match.NONE),  # two times: a hedge, not an answer
        (MEETING, "4 PM", Match.NONE),
        (INVOICE, "1200 dollars", Match.NORMALISED),
        (INVOICE, "$1,200", Match.NORMALISED),
        (INVOICE, "12000", Match.NONE),
        (DEADLINE, "Mar 14", Match.NORMALISED),
        (DEADLINE, "It is due on March 15", Match.NONE),
        (FLIGHT, "ua482", Match.EXACT),  # an alias
        (FLIGHT, "Flight UA 482", Match.CONTAINS),
    ],
)
def test_match_answer(question: Question, answer: str, expected: Match) -> None:
    assert match_answer(question, answer) is expected


def test_contains_refuses_a_long_list_of_guesses() -> None:
    guess_list = "Room 1A, Room 2B, Room 3C, Room 4D, Room 5E, Cedar room"
    question = Question("q", "me", "Which room?", "Cedar room", (), ("m",), "body", "test")
    assert match_answer(question, guess_list) is Match.NONE
    assert match_answer(question, "It is in the Cedar room.") is Match.CONTAINS


@pytest.mark.parametrize("answer", ["I don't know", "I do not know.", "i dont know", "I don’t know", "IDK",
                                    "I could not find it", "I can't find the email", "Unknown", "Not found"])
def test_dont_know_forms(answer: str) -> None:
    assert is_dont_know(answer)


@pytest.mark.parametrize("answer", ["3:30 PM", "I know: 3:30 PM", "Northwind Traders"])
def test_answers_are_not_dont_know(answer: str) -> None:
    assert not is_dont_know(answer)


# ----------------------------------------------------------------------------------------- answers


def test_answer_component_values() -> None:
    assert grade(MEETING, "3:30 PM", (), NOTHING_DONE).answer == 1.0
    assert grade(MEETING, "I don't know", (), NOTHING_DONE).answer == 0.0
    assert grade(MEETING, None, (), NOTHING_DONE).answer == -0.75
    assert grade(MEETING, "   ", (), NOTHING_DONE).verdict is Verdict.MISSING
    assert grade(MEETING, "4 PM", (), NOTHING_DONE).answer == -1.0


def test_wrong_is_below_dont_know_is_below_right_whatever_the_partial_credit() -> None:
    """The bands never overlap: every combination of found/read/sources/invalid calls/turns."""
    stats_options = [
        TrajectoryStats(turns=t, max_turns=5, invalid_tool_calls=i, emails_found=f, emails_read=r)
        for t, i, f, r in itertools.product((1, 5), (0, 9), (frozenset(), frozenset({"m1"})), (frozenset(), frozenset({"m1"})))
    ]
    sources_options = [(), ("m1",), ("m9",)]

    def totals(answer: str | None) -> list[float]:
        return [grade(MEETING, answer, s, st).total for s in sources_options for st in stats_options]

    wrong, dont_know, missing, right = totals("4 PM"), totals("I don't know"), totals(None), totals("3:30 PM")
    assert max(wrong) < min(dont_know)
    assert max(dont_know) < min(right)
    assert max(missing) <= min(dont_know)  # not answering never beats an honest "I don't know"
    assert (min(wrong), max(wrong), min(dont_know), max(dont_know), min(right), max(right)) == pytest.approx(
        (-1.5, -0.6, -0.5, 0.4, 0.5, 1.5))
    assert (min(missing), max(missing)) == pytest.approx((-1.25, -0.55))


def test_a_run_of_malformed_calls_scores_below_a_clean_wrong_answer() -> None:
    """Otherwise RL would teach a weak model that broken tool calls beat trying and being wrong."""
    spiral = TrajectoryStats(turns=5, max_turns=5, invalid_tool_calls=4, emails_found=frozenset({"m1"}))
    clean = TrajectoryStats(turns=2, max_turns=5, emails_found=frozenset({"m1"}))
    assert grade(MEETING, None, (), spiral).total < grade(MEETING, "4 PM", ("m1",), clean).total


# ----------------------------------------------------------------------------------------- sources


def test_sources_credit_is_f1_of_cited_against_true_sources() -> None:
    weights = RewardWeights()
    assert grade(DEADLINE, "March 14", ("m3", "m4"), NOTHING_DONE).sources == pytest.approx(weights.sources)
    one_of_two = grade(DEADLINE, "March 14", ("m4",), NOTHING_DONE)  # precision 1, recall 0.5: F1 2/3
    assert one_of_two.sources == pytest.approx(weights.sources * 2 / 3)
    assert one_of_two.sources_correct
    with_a_wrong_one = grade(DEADLINE, "March 14", ("m4", "m9"), NOTHING_DONE)  # precision 0.5, recall 0.5
    assert with_a_wrong_one.sources == pytest.approx(weights.sources * 0.5)
    assert not with_a_wrong_one.sources_correct
    assert grade(DEADLINE, "March 14", (), NOTHING_DONE).sources == 0.0
    assert grade(DEADLINE, "March 14", ("m9",), NOTHING_DONE).sources == 0.0


# ------------------------------------------------------------------------------------ partial credit


def test_partial_credit_for_finding_and_reading_the_right_email() -> None:
    found_one = TrajectoryStats(turns=3, max_turns=5, emails_found=frozenset({"m3", "m8"}))
    read_both = TrajectoryStats(turns=3, max_turns=5, emails_found=frozenset({"m3", "m4"}), emails_read=frozenset({"m3", "m4"}))
    assert grade(DEADLINE, None, (), found_one).found == pytest.approx(0.05)  # one of the two sources
    assert grade(DEADLINE, None, (), found_one).read == 0.0
    breakdown = grade(DEADLINE, "I don't know", (), read_both)
    assert (breakdown.found, breakdown.read) == pytest.approx((0.1, 0.1))
    assert breakdown.total == pytest.approx(0.2)
    # Reading an unrelated email earns nothing.
    assert grade(DEADLINE, None, (), TrajectoryStats(turns=3, max_turns=5, emails_read=frozenset({"m9"}))).read == 0.0


def test_turn_bonus_rewards_fewer_turns_for_correct_answers_only() -> None:
    def turns_bonus(answer: str, turns: int) -> float:
        return grade(MEETING, answer, ("m1",), TrajectoryStats(turns=turns, max_turns=5)).turns

    assert turns_bonus("3:30 PM", 1) == pytest.approx(0.1)
    assert turns_bonus("3:30 PM", 3) == pytest.approx(0.05)
    assert turns_bonus("3:30 PM", 5) == 0.0
    assert turns_bonus("I don't know", 1) == 0.0  # no prize for giving up fast
    assert turns_bonus("4 PM", 1) == 0.0


def test_invalid_tool_calls_cost_up_to_a_floor() -> None:
    def invalid(n: int) -> float:
        return grade(MEETING, "3:30 PM", (), TrajectoryStats(turns=3, max_turns=5, invalid_tool_calls=n)).invalid

    assert [invalid(n) for n in (0, 1, 2, 3, 7)] == pytest.approx([0.0, -0.2, -0.4, -0.5, -0.5])


def test_a_perfect_episode() -> None:
    stats = TrajectoryStats(turns=3, max_turns=5, emails_found=frozenset({"m1"}), emails_read=frozenset({"m1"}))
    breakdown = grade(MEETING, "3:30 PM", ("m1",), stats)
    assert breakdown.total == pytest.approx(1.0 + 0.2 + 0.1 + 0.1 + 0.05)
    metrics = breakdown.metrics()
    assert metrics["answer_correct"] == 1.0 and metrics["sources_correct"] == 1.0
    assert metrics["reward/answer"] + metrics["reward/sources"] + metrics["reward/found"] + metrics["reward/read"] \
        + metrics["reward/turns"] + metrics["reward/invalid"] == pytest.approx(breakdown.total)


def test_weights_are_configurable() -> None:
    harsh = RewardWeights(wrong=-2.0, found=0.0)
    stats = TrajectoryStats(turns=2, max_turns=5, emails_found=frozenset({"m1"}))
    breakdown = grade(MEETING, "4 PM", (), stats, weights=harsh)
    assert (breakdown.answer, breakdown.found) == (-2.0, 0.0)


# ------------------------------------------------------------------------------------------- judge


def test_judge_is_asked_only_when_the_rules_say_wrong() -> None:
    asked: list[str] = []

    def judge(question: Question, answer: str) -> bool:
        asked.append(answer)
        return answer == "half past three in the afternoon"

    assert grade(MEETING, "3:30 PM", (), NOTHING_DONE, judge=judge).match is Match.EXACT
    assert grade(MEETING, "I don't know", (), NOTHING_DONE, judge=judge).verdict is Verdict.DONT_KNOW
    assert grade(MEETING, None, (), NOTHING_DONE, judge=judge).verdict is Verdict.MISSING
    accepted = grade(MEETING, "half past three in the afternoon", (), NOTHING_DONE, judge=judge)
    assert (accepted.verdict, accepted.match, accepted.answer) == (Verdict.CORRECT, Match.JUDGE, 1.0)
    assert accepted.metrics()["answer_judged"] == 1.0
    rejected = grade(MEETING, "teatime", (), NOTHING_DONE, judge=judge)
    assert rejected.verdict is Verdict.WRONG
    assert asked == ["half past three in the afternoon", "teatime"]


async def test_async_judge() -> None:
    asked: list[str] = []

    async def judge(question: Question, answer: str) -> bool:
        asked.append(answer)
        return "half past three" in answer

    assert (await grade_with_async_judge(MEETING, "15:30", (), NOTHING_DONE, judge)).match is Match.NORMALISED
    judged = await grade_with_async_judge(MEETING, "half past three", ("m1",), NOTHING_DONE, judge)
    assert judged.verdict is Verdict.CORRECT and judged.match is Match.JUDGE
    assert (await grade_with_async_judge(MEETING, "teatime", (), NOTHING_DONE, judge)).verdict is Verdict.WRONG
    assert asked == ["half past three", "teatime"]
