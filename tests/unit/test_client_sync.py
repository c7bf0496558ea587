"""The client's sync API is generated from its async one (`artlike._syncify`): which transport and sleep a sync
call uses, sync calls from inside a running event loop, and that no `_sync` method is written by hand."""

from __future__ import annotations

import inspect

import httpx
import orjson

import artlike as art
from artlike.types import ModelInfo

SERVER = "http://artlike.test"


def model_info(step: int) -> httpx.Response:
    info = ModelInfo(name="agent", base_model="base/model", lora=art.LoraConfig(), latest_step=step,
                     served_name=f"agent@{step}", created_at=1.0)
    return httpx.Response(200, content=orjson.dumps(info.model_dump(mode="json")))


class SyncOnlyTransport(httpx.BaseTransport):
    """A transport only a sync client could use (like httpx.WSGITransport)."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.requests = 0
        self.closed = False

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.requests += 1
        return model_info(self.step)

    def close(self) -> None:
        self.closed = True


def test_sync_calls_use_the_sync_transport_and_async_calls_the_async_one() -> None:
    sync_transport = SyncOnlyTransport(step=7)
    model = art.TrainableModel("agent", "base/model", SERVER, transport=httpx.MockTransport(lambda r: model_info(3)),
                               sync_transport=sync_transport)
    assert model.get_step_sync() == 7
    assert art.TrainableModel("agent", "base/model", SERVER,
                              transport=httpx.MockTransport(lambda r: model_info(3))).get_step_sync() == 3
    model.close()
    assert sync_transport.requests == 1 and sync_transport.closed


async def test_sync_calls_work_inside_a_running_event_loop() -> None:
    sync_transport = SyncOnlyTransport(step=5)
    model = art.TrainableModel("agent", "base/model", SERVER, transport=httpx.MockTransport(lambda r: model_info(2)),
                               sync_transport=sync_transport)
    assert model.get_step_sync() == 5
    assert await model.get_step() == 2


def test_sync_retries_wait_with_the_sync_sleep_only() -> None:
    answers = iter([httpx.Response(503, headers={"Retry-After": "2"}), model_info(4)])
    waited: list[str] = []

    async def sleep(seconds: float) -> None:
        waited.append(f"async {seconds}")

    policy = art.RetryPolicy(sleep=sleep, sync_sleep=lambda seconds: waited.append(f"sync {seconds}"))
    model = art.TrainableModel("agent", "base/model", SERVER, retry=policy,
                               transport=httpx.MockTransport(lambda r: next(answers)))
    assert model.get_step_sync() == 4
    assert waited == ["sync 2.0"]


# The sync methods whose signature differs from their async one's (an `on_event` callback, an iterator, a
# classmethod); each still only runs the async method (`run_sync` / `iterate_sync`).
SHAPED_BY_HAND = {"TrainableModel.train_sync", "TrainableModel.train_sft_sync", "TrainableModel.train_dpo_sync",
                  "TrainableModel.train_reward_model_sync", "Jobs.follow_sync", "TrainingSession.open_sync"}


def test_every_sync_method_is_generated_from_its_async_method() -> None:
    for cls in (art.TrainableModel, art.Jobs, art.TrainingSession, art.Trajectory):
        for name, method in vars(cls).items():
            if not name.endswith("_sync") or f"{cls.__name__}.{name}" in SHAPED_BY_HAND:
                continue
            async_method = getattr(cls, name.removesuffix("_sync"))
            assert inspect.iscoroutinefunction(async_method), name
            assert getattr(method, "__wrapped__", None) is async_method, f"{cls.__name__}.{name} is written by hand"
            assert inspect.signature(method) == inspect.signature(async_method)
