"""The email agent's training script helpers: the curriculum of question kinds, the warm-start rounds, reward
weight overrides and the paired bootstrap."""

from __future__ import annotations

import itertools

import pytest

from examples.email_agent.evaluate import paired_bootstrap
from examples.email_agent.records import Question
from examples.email_agent.reward import DEFAULT_WEIGHTS
from examples.email_agent.train import curriculum, parse_curriculum, reward_weights, warm_start_rounds


def _questions() -> list[Question]:
    return [Question(id=f"{kind}{i}", inbox="a", question="?", answer="x", answer_aliases=(), source_ids=("m",),
                     kind=kind, split="train")  # type: ignore[arg-type]
            for kind in ("subject", "body", "thread") for i in range(3)]


def test_parse_curriculum_makes_the_last_phase_open_ended() -> None:
    assert parse_curriculum("subject@6,subject+body@4", "unused") == [(("subject",), 6), (("subject", "body"), None)]
    assert parse_curriculum(None, "subject,body") == [(("subject", "body"), None)]


def test_curriculum_serves_each_phase_its_kinds_for_its_steps() -> None:
    phases = [(("subject",), 2), (("subject", "body"), 1), (("thread",), None)]
    kinds = [q.kind for q in itertools.islice(curriculum(phases, _questions(), 3, seed=0), 15)]  # type: ignore[arg-type]
    assert kinds[:6] == ["subject"] * 6
    assert set(kinds[6:9]) <= {"subject", "body"}
    assert kinds[9:] == ["thread"] * 6  # the last phase has no end: its questions cycle
    # every question once per epoch within a phase: 3 subject questions, each twice in 6 draws
    first = [q.id for q in itertools.islice(curriculum(phases, _questions(), 3, seed=0), 6)]  # type: ignore[arg-type]
    assert sorted(first) == sorted(["subject0", "subject1", "subject2"] * 2)


def test_curriculum_refuses_a_phase_without_questions() -> None:
    with pytest.raises(SystemExit, match="no training questions"):
        next(curriculum([(("nonexistent",), None)], _questions(), 2, seed=0))  # type: ignore[list-item]


def test_paired_bootstrap_worked_examples() -> None:
    # 16 copies of 4 questions: one answered before, three after: +50 points, well clear of zero.
    difference = paired_bootstrap([0, 0, 0, 1] * 16, [1, 1, 0, 1] * 16)
    assert (difference.before, difference.after, difference.difference) == (0.25, 0.75, 0.5)
    assert 0.3 < difference.low < 0.5 < difference.high < 0.7
    # The same answers before and after: no difference and no spread.
    same = paired_bootstrap([1, 0] * 32, [1, 0] * 32)
    assert (same.difference, same.low, same.high) == (0.0, 0.0, 0.0)
    # One question of 64 flips: an interval that includes zero.
    one = paired_bootstrap([0] * 64, [1] + [0] * 63)
    assert one.low == 0.0 and one.high > 0
    with pytest.raises(ValueError, match="same questions"):
        paired_bootstrap([1.0], [])


def test_warm_start_rounds_take_fresh_questions_until_the_pool_is_used_up() -> None:
    pool = _questions()  # 9 questions
    rounds = warm_start_rounds(pool, 4, 3, seed=1)
    assert [len(r) for r in rounds] == [4, 4, 4]
    first_eight = [q.id for r in rounds[:2] for q in r]
    assert len(set(first_eight)) == 8  # no repeats before every question has had its turn
    assert len({q.id for r in rounds for q in r}) == 9
    assert rounds == warm_start_rounds(pool, 4, 3, seed=1)  # seeded
    assert [len(r) for r in warm_start_rounds(pool[:2], 4, 2, seed=0)] == [2, 2]  # a round never repeats a question


def test_reward_weight_overrides() -> None:
    weights = reward_weights(["wrong=0", " dont_know = -0.25"])
    assert (weights.wrong, weights.dont_know, weights.correct) == (0.0, -0.25, DEFAULT_WEIGHTS.correct)
    assert reward_weights([]) == DEFAULT_WEIGHTS
    with pytest.raises(ValueError, match="no such weight"):
        reward_weights(["right=1"])
    with pytest.raises(ValueError, match="not a number"):
        reward_weights(["wrong=zero"])


def test_inboxes_option_scales_the_test_split_and_refuses_out_of_range(capsys: pytest.CaptureFixture[str]) -> None:
    from examples.email_agent.data import MAX_INBOXES, generate
    from examples.email_agent.train import _parse_args

    assert _parse_args([]).inboxes == 4
    assert _parse_args(["--inboxes", str(MAX_INBOXES)]).inboxes == MAX_INBOXES
    with pytest.raises(SystemExit):
        _parse_args(["--inboxes", str(MAX_INBOXES + 1)])
    assert "--inboxes" in capsys.readouterr().err
    # Why the option exists: twice the inboxes, about twice the held-out questions of each kind.
    small, large = (sum(q.split == "test" and q.kind == "subject" for q in generate(0, inboxes=n).questions)
                    for n in (4, 8))
    assert 1.7 * small <= large <= 2.3 * small
