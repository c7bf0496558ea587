"""A reward model from the studio's ratings: the request built from rated answers (a pure function, with the
module docstring's worked example), which ratings count (train split, the policy's, still in the log), and the
route's validation and NDJSON stream (a stand-in training service: no trainer here)."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar

import httpx
import orjson
import pytest
from artlike_server.app import create_app
from artlike_server.errors import APIError, InvalidRequest, NotFound
from artlike_server.studio.feedback import RatedAnswer
from artlike_server.studio.reward_training import (
    RatingsRewardTrainer,
    reward_model_request,
    train_reward_model,
)
from artlike_server.studio.store import NewRating, StudioStore
from pydantic import ValidationError

from artlike.studio_types import RewardModelFromRatings
from artlike.types import (
    STREAM_VERSION,
    DoneEvent,
    RecordedPair,
    RewardHeadConfig,
    RewardModelConfig,
    TrainRequest,
)
from tests.unit.fake_services import fake_services

T = TypeVar("T")


def answer(cid: int, prompt: str, reward: float) -> RatedAnswer:
    return RatedAnswer(cid, f"t{cid}", prompt, reward)


def body(**fields: Any) -> RewardModelFromRatings:
    return RewardModelFromRatings.model_validate({"model": "rm", **fields})


# ------------------------------------------------------------------------------------ the request


def test_worked_example_pairs_and_scores() -> None:
    # The module docstring's: (a, 1.0) (a, 0.25) (b, 0.5) -> one pair of prompt a; every answer scored.
    answers = [answer(1, "a", 1.0), answer(2, "a", 0.25), answer(3, "b", 0.5)]
    request = reward_model_request(body(), answers)
    assert request.pairs == [RecordedPair(chosen_trajectory_id="t1", rejected_trajectory_id="t2",
                                          chosen_completion_id=1, rejected_completion_id=2)]
    assert [(s.trajectory_id, s.completion_id, s.targets) for s in request.scored] == \
        [("t1", 1, [1.0]), ("t2", 2, [0.25]), ("t3", 3, [0.5])]
    assert isinstance(request.config, RewardModelConfig) and request.promote is True
    assert request.annotations == {"source": "ratings", "rated_answers": 3, "pairs": 1, "scored": 3}
    # It is a valid /_train_model body as it stands.
    assert TrainRequest.model_validate_json(request.model_dump_json()) == request


def test_from_pairs_or_scores_only_and_the_options() -> None:
    answers = [answer(1, "a", 1.0), answer(2, "a", 0.0), answer(3, "b", 0.5)]
    pairs = reward_model_request(body(**{"from": "pairs"}, config={"margin": 0.5, "epochs": 2}, promote=False,
                                      policy="agent"), answers)
    assert (len(pairs.pairs), pairs.scored, pairs.promote) == (1, [], False)
    assert isinstance(pairs.config, RewardModelConfig) and (pairs.config.margin, pairs.config.epochs) == (0.5, 2)
    assert pairs.annotations["policy"] == "agent"
    scores = reward_model_request(body(**{"from": "scores"}), answers)
    assert (scores.pairs, len(scores.scored)) == ([], 3)


def test_nothing_to_train_on_is_no_ratings() -> None:
    with pytest.raises(InvalidRequest) as none:
        reward_model_request(body(policy="agent"), [], pruned=2)
    assert (none.value.code, none.value.status_code) == ("no_ratings", 400)
    assert "'agent'" in none.value.message and "2 rated completions were pruned" in none.value.message
    # Ratings, but no prompt with two answers that differ: no pair.
    with pytest.raises(InvalidRequest) as unpaired:
        reward_model_request(body(**{"from": "pairs"}), [answer(1, "a", 1.0), answer(2, "b", 0.0),
                                                         answer(3, "c", 0.5), answer(4, "c", 0.5)])
    assert unpaired.value.code == "no_ratings" and "no preference pair" in unpaired.value.message


def test_scores_need_a_reward_model_with_one_objective() -> None:
    answers = [answer(1, "a", 1.0), answer(2, "a", 0.0)]
    for source in ("scores", "both"):
        with pytest.raises(InvalidRequest) as refused:
            reward_model_request(body(**{"from": source}), answers, objectives=2)
        assert (refused.value.code, refused.value.param) == ("too_many_objectives", "from")
    assert len(reward_model_request(body(**{"from": "pairs"}), answers, objectives=2).pairs) == 1


def test_the_body_is_strict() -> None:
    assert body(**{"from": "scores"}).source == "scores"
    for bad in ({"from": "ratings"}, {"config": {"objective": "dpo"}}, {"config": {"beta": 0.1}}, {"extra": 1},
                {"model": "a/b"}):
        with pytest.raises(ValidationError):
            body(**bad)


# ------------------------------------------------------------------------------- which ratings count


class FakeLog:
    """The completion log's `read`, over an in-memory table of the completion ids it still holds."""

    def __init__(self, ids: list[int]) -> None:
        self.db = sqlite3.connect(":memory:")
        self.db.execute("CREATE TABLE completions (id INTEGER PRIMARY KEY)")
        self.db.executemany("INSERT INTO completions (id) VALUES (?)", [(i,) for i in ids])

    async def read(self, work: Callable[[sqlite3.Connection], T]) -> T:
        return work(self.db)


class FakeJob:
    async def stream(self) -> AsyncIterator[Any]:
        yield DoneEvent(model="rm@1", step=1, adapter_path="/x", train_seconds=1.0, swap_seconds=0.0)


class FakeTraining:
    """`TrainingService` as far as this route uses it: the model store, prepare and start."""

    def __init__(self, kind: str = "reward", head: RewardHeadConfig | None = None) -> None:
        models = {"rm": SimpleNamespace(kind=kind, reward_head=head or (RewardHeadConfig() if kind == "reward"
                                                                        else None))}
        self.store = SimpleNamespace(require=lambda name: models.get(name) or self._not_found(name))
        self.prepared: list[TrainRequest] = []

    @staticmethod
    def _not_found(name: str) -> Any:
        raise NotFound(f"model {name!r} is not registered", param="model", code="model_not_found")

    async def prepare(self, request: TrainRequest) -> TrainRequest:
        self.prepared.append(request)
        return request

    def start(self, prepared: TrainRequest) -> FakeJob:
        return FakeJob()


def rating(cid: int, model: str, prompt: str, reward: float, *, split: str = "train",
           rater: str = "ann") -> NewRating:
    return NewRating(cid, f"t{cid}", model, 1, prompt, "scale", 1 + int(reward * 4), reward, None, None, rater, split)


def pair_ids(request: TrainRequest) -> list[tuple[int | None, int | None]]:
    assert all(isinstance(p, RecordedPair) for p in request.pairs)
    return [(p.chosen_completion_id, p.rejected_completion_id) for p in request.pairs if isinstance(p, RecordedPair)]


@pytest.fixture
def studio(tmp_path: Path) -> Iterator[StudioStore]:
    store = StudioStore(tmp_path / "studio.sqlite")
    store.add_ratings([
        rating(1, "agent", "a", 1.0), rating(1, "agent", "a", 0.5, rater="bob"),  # averaged: 0.75
        rating(2, "agent", "a", 0.0),
        rating(3, "agent", "a", 0.25, split="holdout"),  # the guard's: never trained
        rating(4, "other", "b", 1.0), rating(5, "other", "b", 0.0),
        rating(6, "agent", "c", 1.0),  # its completion was pruned from the log
    ])
    yield store
    store.close()


async def test_train_split_of_the_policy_still_in_the_log(studio: StudioStore) -> None:
    training = FakeTraining()
    await train_reward_model(body(policy="agent"), studio, FakeLog([1, 2, 3, 4, 5]), training)
    (request,) = training.prepared
    assert pair_ids(request) == [(1, 2)]
    assert [(s.completion_id, s.targets) for s in request.scored] == [(1, [0.75]), (2, [0.0])]
    await train_reward_model(body(), studio, FakeLog([1, 2, 3, 4, 5, 6]), training)
    every = training.prepared[-1]
    assert sorted(s.completion_id or 0 for s in every.scored) == [1, 2, 4, 5, 6]
    assert pair_ids(every) == [(1, 2), (4, 5)]


async def test_refusals_before_any_training(studio: StudioStore) -> None:
    log = FakeLog([1, 2, 4, 5, 6])
    cases: list[tuple[RewardModelFromRatings, FakeTraining, str]] = [
        (body(), FakeTraining(kind="policy"), "wrong_model_kind"),
        (body(model="nope"), FakeTraining(), "model_not_found"),
        (body(policy="nobody"), FakeTraining(), "no_ratings"),
        (body(), FakeTraining(head=RewardHeadConfig(num_objectives=2)), "too_many_objectives"),
    ]
    for request, training, code in cases:
        with pytest.raises(APIError) as refused:
            await train_reward_model(request, studio, log, training)
        assert refused.value.code == code and training.prepared == []


# ------------------------------------------------------------------------------------------ the route


async def test_the_route_validates_and_streams_the_training_events(studio: StudioStore) -> None:
    training = FakeTraining()
    trainer = RatingsRewardTrainer(studio, FakeLog([1, 2, 4, 5, 6]), training)  # type: ignore[arg-type]
    app = create_app(fake_services(studio=studio, reward_trainer=trainer))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as http:
        answer = await http.post("/v1/ratings/train_reward_model", json={"model": "rm", "from": "pairs"})
        assert answer.status_code == 200 and answer.headers["content-type"] == "application/x-ndjson"
        assert answer.headers["x-artlike-stream-version"] == str(STREAM_VERSION)
        lines = [orjson.loads(line) for line in answer.content.splitlines()]
        assert [line["type"] for line in lines] == ["done"] and lines[0]["model"] == "rm@1"
        assert training.prepared[-1].scored == [] and len(training.prepared[-1].pairs) == 2

        bad = await http.post("/v1/ratings/train_reward_model", json={"model": "rm", "from": "everything"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "from"
        none = await http.post("/v1/ratings/train_reward_model", json={"model": "rm", "policy": "nobody"})
        assert none.status_code == 400 and none.json()["error"]["code"] == "no_ratings"
