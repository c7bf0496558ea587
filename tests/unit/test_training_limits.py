"""`/_train_model`'s limits: what one request may make the server read, build and run is bounded (400s that
name the parameter), and the CPU work of building sequences happens off the event loop."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from artlike_server.completion_log import CompletionLog, NewCompletion
from artlike_server.errors import InvalidRequest
from artlike_server.metrics import Metrics
from artlike_server.models.store import ModelStore
from artlike_server.training.job import TrainingLimits, TrainingService
from artlike_server.training.tokenizer_service import TokenizerService

from artlike.types import LoraConfig, TrainRequest


class Models:
    def latest_step(self, name: str) -> int | None:
        return 0


class Tokenizer:
    """ChatML-ish ids: one token per character; records which threads used it."""

    eos_token_id = 2

    def __init__(self) -> None:
        self.threads: set[threading.Thread] = set()

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> list[int]:
        self.threads.add(threading.current_thread())
        ids: list[int] = []
        for message in conversation:
            ids += [1, *(10 + ord(c) % 50 for c in message.get("content") or ""), 2]
        return ids + ([1] if kwargs.get("add_generation_prompt") else [])

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        return [10 + ord(c) % 50 for c in text]


def recorded(trajectory_id: str, *, tokens: int = 8, choices: int = 1) -> list[NewCompletion]:
    return [NewCompletion(
        trajectory_id=trajectory_id, request_id=f"r-{trajectory_id}", choice_index=i, endpoint="chat.completions",
        model="agent", served_model="agent@0", step=0, request=b"{}", prompt_token_ids=[1, 2, 3],
        output_token_ids=[5] * tokens, logprobs=[-0.5] * tokens, finish_reason="stop", created_at=1.0,
        latency_seconds=0.1) for i in range(choices)]


@pytest.fixture
async def log(tmp_path: Path) -> AsyncIterator[CompletionLog]:
    opened = CompletionLog(tmp_path / "completions.sqlite")
    opened.open()
    await opened.record(recorded("a") + recorded("b") + recorded("long", tokens=100))
    yield opened
    opened.close()


def service(tmp_path: Path, log: CompletionLog, tokenizer: Tokenizer | None = None, **limits: Any) -> TrainingService:
    store = ModelStore(tmp_path)
    store.create("agent", "base", LoraConfig())
    return TrainingService(store, Models(), log, None, Metrics(),  # type: ignore[arg-type]
                           TokenizerService(lambda: tokenizer or Tokenizer()),
                           limits=TrainingLimits(**limits))


def request(*groups: list[dict[str, Any]], **config: Any) -> TrainRequest:
    return TrainRequest.model_validate(
        {"model": "agent", "groups": [{"trajectories": g} for g in groups], "config": config})


PAIR = [{"trajectory_id": "a", "reward": 1.0}, {"trajectory_id": "b", "reward": 0.0}]


async def rejected(job: TrainingService, train: TrainRequest) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        await job.prepare(train)
    return caught.value


async def test_within_the_limits_a_request_is_prepared(tmp_path: Path, log: CompletionLog) -> None:
    prepared = await service(tmp_path, log, max_records=2, max_sequence_tokens=11).prepare(request(PAIR))
    assert [s.token_ids for s in prepared.sequences] == [[1, 2, 3, *[5] * 8]] * 2


async def test_more_recorded_completions_than_the_limit_is_a_400(tmp_path: Path, log: CompletionLog) -> None:
    error = await rejected(service(tmp_path, log, max_records=1), request(PAIR))
    assert (error.param, error.code) == ("groups", "training_data_too_large")
    assert "2 recorded completions, more than the limit of 1" in error.message


async def test_more_recorded_bytes_than_the_limit_is_a_400(tmp_path: Path, log: CompletionLog) -> None:
    error = await rejected(service(tmp_path, log, max_bytes=100), request(PAIR))
    assert (error.param, error.code) == ("groups", "training_data_too_large")


async def test_a_recorded_sequence_over_the_length_limit_is_a_400_naming_it(tmp_path: Path,
                                                                           log: CompletionLog) -> None:
    train = request([{"trajectory_id": "a", "reward": 1.0}, {"trajectory_id": "long", "reward": 0.0}])
    error = await rejected(service(tmp_path, log, max_sequence_tokens=50), train)
    assert (error.param, error.code) == ("groups[0].trajectories[1]", "sequence_too_long")
    assert "trajectory 'long' makes a training sequence of 103 tokens" in error.message


async def test_an_offline_sequence_over_the_length_limit_is_a_400_naming_it(tmp_path: Path,
                                                                           log: CompletionLog) -> None:
    offline = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x" * 200}],
               "reward": 0.0}
    error = await rejected(service(tmp_path, log, max_sequence_tokens=100),
                           request([{"trajectory_id": "a", "reward": 1.0}, offline]))
    assert (error.param, error.code) == ("groups[0].trajectories[1]", "sequence_too_long")


async def test_too_many_gradient_steps_is_a_400(tmp_path: Path, log: CompletionLog) -> None:
    job = service(tmp_path, log, max_gradient_steps=10)
    error = await rejected(job, request(PAIR, epochs=6, gradient_steps_per_epoch=2))
    assert (error.param, error.code) == ("config.epochs", "too_many_gradient_steps")
    assert "12 optimizer steps" in error.message
    # steps per epoch count only up to one per sequence: 6 epochs x 2 sequences is over, 5 x 2 is not
    assert (await job.prepare(request(PAIR, epochs=5, gradient_steps_per_epoch=64))).num_gradient_steps == 10


async def test_offline_trajectories_are_tokenized_off_the_event_loop(tmp_path: Path, log: CompletionLog) -> None:
    tokenizer = Tokenizer()
    offline = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}],
               "reward": 0.0}
    await service(tmp_path, log, tokenizer).prepare(request([{"trajectory_id": "a", "reward": 1.0}, offline]))
    assert tokenizer.threads and threading.current_thread() not in tokenizer.threads


def test_train_request_bodies_are_parsed_with_fastapis_400s() -> None:
    from artlike_server.training.api_router import parse_train_request

    with pytest.raises(InvalidRequest) as caught:
        parse_train_request(b'{"model": "agent", "groups": []}')
    assert (caught.value.param, caught.value.code) == ("groups", "invalid_value")
    with pytest.raises(InvalidRequest) as caught:
        parse_train_request(b"{not json")
    assert caught.value.code == "invalid_json"
    assert parse_train_request(orjson.dumps({"model": "agent", "groups": [{"trajectories": PAIR}]})).model == "agent"


async def test_a_duplicate_among_many_trajectory_ids_is_found_in_linear_time(tmp_path: Path,
                                                                             log: CompletionLog) -> None:
    many = [{"trajectory_id": f"t{i}", "reward": float(i % 2)} for i in range(200_000)]
    error = await rejected(service(tmp_path, log), request([*many, {"trajectory_id": "t199999", "reward": 0.0}]))
    assert (error.param, error.code) == ("groups", "duplicate_trajectory")
    assert "'t199999'" in error.message
