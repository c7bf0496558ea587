"""The studio's pure parts: rewards from ratings, GRPO groups, DPO pairs, the guard's shift, the rating store."""

from __future__ import annotations

from pathlib import Path

import pytest
from artlike_server.models.manager import ModelManager
from artlike_server.studio import guard
from artlike_server.studio.feedback import (
    RatedAnswer,
    dpo_pairs,
    grpo_groups,
    is_holdout,
    preference_shift,
    rating_reward,
)
from artlike_server.studio.ratings import rated_answers
from artlike_server.studio.store import NewRating, StudioStore

from artlike.studio_types import ContinualPolicy, GuardPolicy
from artlike.types import CompletionRecord

from .test_model_manager import FakeEngine, make_store


def test_rewards_of_each_kind() -> None:
    assert rating_reward("thumb", "up") == 1.0
    assert rating_reward("thumb", "down") == 0.0
    assert [rating_reward("scale", v) for v in range(1, 6)] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert [rating_reward("ranking", None, rank=r, ranked=3) for r in range(3)] == [1.0, 0.5, 0.0]
    assert rating_reward("skip", None) is None
    with pytest.raises(ValueError, match="unknown rating kind"):
        rating_reward("stars", 3)


def _answer(cid: int, prompt: str, reward: float) -> RatedAnswer:
    return RatedAnswer(cid, f"t{cid}", prompt, reward)


def test_grpo_groups_worked_example() -> None:
    # The module docstring's example: prompt a has two different ratings -> its own group; the rest pooled.
    answers = [_answer(1, "a", 1), _answer(2, "a", 0), _answer(3, "b", 1), _answer(4, "c", 0),
               _answer(5, "d", 1), _answer(6, "d", 1)]
    groups = grpo_groups(answers)
    assert [[a.completion_id for a in g] for g in groups] == [[1, 2], [3, 4, 5, 6]]


def test_grpo_groups_without_signal() -> None:
    assert grpo_groups([_answer(1, "a", 1), _answer(2, "b", 1)]) == []  # all thumbs up: nothing to learn
    assert grpo_groups([_answer(1, "a", 1)]) == []
    # Only per-prompt groups, no pool when the rest has no spread.
    groups = grpo_groups([_answer(1, "a", 1), _answer(2, "a", 0), _answer(3, "b", 1)])
    assert [[a.completion_id for a in g] for g in groups] == [[1, 2]]


def test_dpo_pairs_largest_margin_first_within_a_prompt() -> None:
    answers = [_answer(1, "a", 0.5), _answer(2, "a", 1.0), _answer(3, "a", 0.0), _answer(4, "b", 1.0),
               _answer(5, "c", 0.25), _answer(6, "c", 0.25)]
    pairs = [(b.completion_id, w.completion_id) for b, w in dpo_pairs(answers)]
    assert pairs == [(2, 3), (1, 3), (2, 1)]  # margins 1.0, 0.5, 0.5; b alone and c's tie give none
    assert [(b.completion_id, w.completion_id) for b, w in dpo_pairs(answers, max_per_prompt=1)] == [(2, 3)]


def test_preference_shift_worked_example() -> None:
    # rewards 1, 1, 0 (mean 2/3): Δ of the better answers +0.2 and +0.4, of the worse -0.1
    # shift = mean(0.2, 0.4) - mean(-0.1) = 0.4
    assert preference_shift([1, 1, 0], [0.2, 0.4, -0.1]) == pytest.approx(0.4)
    # a candidate that moved toward the worse answer
    assert preference_shift([1, 0], [-0.3, 0.2]) == pytest.approx(-0.5)
    assert preference_shift([1, 1], [0.1, 0.2]) is None
    with pytest.raises(ValueError):
        preference_shift([1, 0], [0.1])


def test_holdout_split_is_stable_and_follows_the_fraction() -> None:
    keys = [f"{i * 2654435761 % 2**32:08x}" + "0" * 32 for i in range(2000)]
    held = [k for k in keys if is_holdout(k, 0.2)]
    assert 0.15 < len(held) / len(keys) < 0.25
    assert held == [k for k in keys if is_holdout(k, 0.2)]
    assert not any(is_holdout(k, 0.0) for k in keys)


def _new(cid: int, rater: str = "ann", reward: float | None = 1.0, prompt: str = "p", split: str = "train",
         kind: str = "thumb") -> NewRating:
    return NewRating(cid, f"t{cid}", "m", 1, prompt, kind, "up" if reward else "down", reward, None, None, rater,
                     split)


def test_store_replaces_a_raters_second_rating_and_averages_raters(tmp_path: Path) -> None:
    store = StudioStore(tmp_path / "studio.sqlite")
    first = store.add_ratings([_new(1, reward=1.0)])[0]
    second = store.add_ratings([_new(1, reward=0.0)])[0]  # ann changes her mind: one row, a new id
    store.add_ratings([_new(1, rater="bob", reward=1.0), _new(2, reward=None, kind="skip")])
    rows = store.list_ratings(model="m")
    assert second.id > first.id and next(r.rating.id for r in rows if r.rating.rater == "ann") == second.id
    assert len(rows) == 3
    answers = rated_answers(rows)
    assert [(a.completion_id, a.reward) for a in answers] == [(1, 0.5)]  # the skip gives no answer
    assert store.count("m", untrained=True) == 2
    store.mark_trained([second.id], step=3)
    assert store.count("m", untrained=True) == 1 and store.count("m", untrained=False) == 1
    assert store.rated_completion_ids([1, 2, 3]) == {1, 2}
    store.close()


def test_store_keeps_policies_and_rewards(tmp_path: Path) -> None:
    store = StudioStore(tmp_path / "studio.sqlite")
    assert store.policy("m") == ContinualPolicy()
    policy = ContinualPolicy(enabled=True, every=4, guard=GuardPolicy(enabled=True, margin=0.1))
    store.set_policy("m", policy)
    store.record_rewards("m", 2, [("a", 0.5), ("b", -1.0)])
    store.record_rewards("m", 3, [("a", 1.0)])
    store.close()
    reopened = StudioStore(tmp_path / "studio.sqlite")
    assert reopened.policy("m") == policy and reopened.enabled_models() == ["m"]
    assert reopened.rewards(["a", "b", "c"]) == {"a": 1.0, "b": -1.0}
    assert reopened.trajectories_with_reward(0.0, None) == ["a"]
    reopened.close()


class ScoringEngine:
    """Stands in for vLLM's prompt logprobs: the candidate step gains `gain[completion]` nats per token."""

    def __init__(self, gain: dict[int, float]) -> None:
        self.gain = gain
        self.calls: list[str] = []

    async def token_logprobs(self, model: str, token_ids: list[int], start: int) -> list[float]:
        self.calls.append(model)
        completion = token_ids[-1]  # the tests' answers end with their completion id
        bonus = self.gain[completion] if model == "m@2" else 0.0
        return [-1.0 + bonus] * (len(token_ids) - start)


def _record(cid: int) -> CompletionRecord:
    return CompletionRecord(id=cid, trajectory_id=f"t{cid}", request_id="r", choice_index=0,
                            endpoint="chat.completions", model="m", served_model="m@1", step=1, request={},
                            prompt_token_ids=[5, 6, 7], output_token_ids=[8, cid], logprobs=[-1.0, -1.0],
                            finish_reason="stop", created_at=0.0, latency_seconds=0.0)


@pytest.mark.parametrize(("gains", "promoted"), [({1: 0.3, 2: -0.2}, True), ({1: -0.3, 2: 0.2}, False)])
async def test_guard_promotes_only_a_step_that_moves_toward_held_out_preferences(
        tmp_path: Path, gains: dict[int, float], promoted: bool) -> None:
    manager = ModelManager(make_store(tmp_path, 3), FakeEngine(), "base")  # type: ignore[arg-type]
    await manager.restore()
    answers = [_answer(1, "p", 1.0), _answer(2, "p", 0.0)]  # 1 is the better answer
    verdict = await guard.judge(ScoringEngine(gains), manager, "m", 2, 1, answers,  # type: ignore[arg-type]
                                {1: _record(1), 2: _record(2)}, GuardPolicy(enabled=True, margin=0.1))
    assert verdict.promoted is promoted and verdict.answers == 2
    assert verdict.shift == pytest.approx(gains[1] - gains[2])
    assert verdict.reason.startswith("promoted" if promoted else "not promoted")


async def test_guard_promotes_when_held_out_ratings_cannot_tell(tmp_path: Path) -> None:
    manager = ModelManager(make_store(tmp_path, 3), FakeEngine(), "base")  # type: ignore[arg-type]
    await manager.restore()
    engine = ScoringEngine({})
    verdict = await guard.judge(engine, manager, "m", 2, 1, [_answer(1, "p", 1.0)],  # type: ignore[arg-type]
                                {1: _record(1)}, GuardPolicy(enabled=True))
    assert verdict.promoted and verdict.shift is None and "no held-out ratings" in verdict.reason
    assert engine.calls == []  # nothing to judge: nothing scored
