"""The app's start task: any failure ends the process (via on_fatal), never a /health stuck at 503."""

from __future__ import annotations

from typing import Any, cast

from artlike_server.services import start_engine_then_trainer
from artlike_server.state import Services


class _FailingEngine:
    async def start(self) -> None:
        raise KeyError("restore blew up")  # e.g. an on_ready callback (restore) raising something unexpected


class _Trainer:
    started = False

    async def start(self) -> None:
        self.started = True


class _State:
    def __init__(self) -> None:
        self.engine = _FailingEngine()
        self.trainer = _Trainer()


async def test_an_unexpected_error_in_the_start_task_calls_on_fatal() -> None:
    fatal: list[BaseException] = []
    state: Any = _State()
    await start_engine_then_trainer(cast(Services, state), fatal.append)
    assert len(fatal) == 1 and isinstance(fatal[0], KeyError)
    assert not state.trainer.started
