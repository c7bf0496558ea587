"""The composition root (`services.build_services`): the real parts, started in dependency order and stopped
in reverse, every stop run even when one of them raises."""

from __future__ import annotations

from pathlib import Path

import pytest
from artlike_server.completion_log import CompletionLog
from artlike_server.engine.pool import EnginePool
from artlike_server.jobs.service import JobService
from artlike_server.services import build_services
from artlike_server.settings import ScaleOutSettings, ServerSettings
from artlike_server.studio.store import StudioStore
from artlike_server.training.trainer_client import TrainerProcess


def settings(tmp_path: Path) -> ServerSettings:
    # No engine to launch: one remote engine nobody runs (its start in the background fails harmlessly).
    return ServerSettings(model_path=tmp_path / "model", served_model_name="base", data_dir=tmp_path / "data",
                          scale_out=ScaleOutSettings(engines=0, engine_urls=("http://127.0.0.1:9",)))


async def test_parts_stop_in_reverse_order_even_when_a_stop_raises(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    stopped: list[str] = []

    def recording(name: str, stop: object, *, fails: bool = False) -> object:
        async def async_stop(self: object) -> None:
            stopped.append(name)
            await stop(self)  # type: ignore[operator]
            if fails:
                raise RuntimeError(f"{name} failed to stop")

        def sync_stop(self: object) -> None:
            stopped.append(name)
            stop(self)  # type: ignore[operator]

        return sync_stop if name in {"studio", "log"} else async_stop

    monkeypatch.setattr(CompletionLog, "close", recording("log", CompletionLog.close))
    monkeypatch.setattr(EnginePool, "stop", recording("engine", EnginePool.stop))
    monkeypatch.setattr(TrainerProcess, "stop", recording("trainer", TrainerProcess.stop))
    monkeypatch.setattr(JobService, "shutdown", recording("jobs", JobService.shutdown, fails=True))
    monkeypatch.setattr(StudioStore, "close", recording("studio", StudioStore.close))

    with pytest.raises(RuntimeError, match="jobs failed to stop"):
        async with build_services(settings(tmp_path)) as services:
            assert services.base_model.name == "base" and services.requests.max_recorded_choices == 16
            assert stopped == []
    # Built log -> engine -> trainer -> jobs -> studio; stopped newest first, and jobs' failure skips nothing.
    assert stopped == ["studio", "jobs", "trainer", "engine", "log"]
