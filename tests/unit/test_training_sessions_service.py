"""The server side of training sessions (`training/sessions.py`) against a stand-in trainer: the rules a
caller relies on — one session per model and none beside a job, 400s that keep the session, a call that
waited while the session ended gets 404, a restarted trainer loses the session (409) and frees the model,
idle sessions end. The real worker runs in tests/integration/test_training_sessions.py."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from artlike_server.errors import Conflict, InvalidRequest, NotFound
from artlike_server.models.store import ModelStore
from artlike_server.trainer_ipc import protocol
from artlike_server.trainer_ipc.batch_file import read_batch
from artlike_server.trainer_ipc.sequences import TrainSequence
from artlike_server.trainer_ipc.tinker_loss import TinkerLossConfig
from artlike_server.training.job import TrainingService
from artlike_server.training.sessions import TrainingSessions
from artlike_server.training.tokenizer_service import TokenizerService
from artlike_server.training.trainer_client import TrainerError

from artlike.session_types import ForwardRequest, OpenSessionRequest, OptimStepRequest
from artlike.types import LoraConfig, RewardHeadConfig


class StandInTrainer:
    """Answers session commands as the worker would; `fail_with` makes the next command fail."""

    def __init__(self) -> None:
        self.pid = 100
        self.is_running = True
        self.commands: list[str] = []
        self.fail_with: str | None = None
        self.gate: asyncio.Event | None = None  # when set, commands wait for it
        self.arrived = asyncio.Event()  # set when a command reaches the stand-in (before the gate)
        self.batches: list[tuple[Any, list[TrainSequence]]] = []  # each pass's config and the sequences it read

    async def session_command(self, command: Any) -> protocol.WorkerEvent:
        self.arrived.set()
        if self.gate is not None:
            await self.gate.wait()
        self.commands.append(command.cmd)
        if self.fail_with is not None:
            kind, self.fail_with = self.fail_with, None
            raise TrainerError(kind, f"{kind} from the stand-in")
        if isinstance(command, protocol.Pass):
            self.batches.append((command.config, read_batch(Path(command.batch_path))))
            return protocol.PassDone(id=command.id, loss=1.0, tokens=3, objective="sft", metrics={},
                                     logprobs=[[None, -1.0, -2.0, -3.0]], seconds=0.0)
        if isinstance(command, protocol.OptimStep):
            return protocol.Optimized(id=command.id, grad_norm=0.5, seconds=0.0)
        if isinstance(command, protocol.SessionClose):
            return protocol.Closed(id=command.id)
        return protocol.SessionReady(id=command.id, optimizer_state="fresh")


@pytest.fixture
def sessions(tmp_path: Path) -> tuple[TrainingSessions, StandInTrainer]:
    store = ModelStore(tmp_path)
    store.create("m", "base", LoraConfig())
    step0 = store.step_dir("m", 0)
    step0.mkdir(parents=True)
    (step0 / "adapter_config.json").write_text("{}")
    trainer = StandInTrainer()
    models: Any = SimpleNamespace(latest_step=lambda name: 0)
    training = TrainingService(store, models, completion_log=None, trainer=trainer, metrics=None,  # type: ignore[arg-type]
                               tokenizer=TokenizerService(lambda: None))
    return TrainingSessions(store, models, None, trainer, training), trainer  # type: ignore[arg-type]


BATCH = ForwardRequest(sequences=[{"token_ids": [5, 6, 7, 8]}])  # type: ignore[list-item]


async def test_one_session_per_model_and_its_rules(sessions: tuple[TrainingSessions, StandInTrainer]) -> None:
    service, trainer = sessions
    info = await service.open(OpenSessionRequest(model="m"))
    with pytest.raises(Conflict, match="already has an open training session"):
        await service.open(OpenSessionRequest(model="m"))
    with pytest.raises(Conflict) as job:  # a /_train_model job on it is refused too
        service.training.reserve_for_session("m", "someone-else")
    assert job.value.code == "session_open"
    with pytest.raises(Conflict, match="forward_backward first"):
        await service.optim_step(info.id, OptimStepRequest())
    trainer.fail_with = "BatchError"
    with pytest.raises(InvalidRequest):
        await service.forward_backward(info.id, BATCH)
    result = await service.forward_backward(info.id, BATCH)  # the session survived the bad batch
    assert result.pending_passes == 1 and result.sequences[0].logprobs == [None, -1.0, -2.0, -3.0]
    assert (await service.optim_step(info.id, OptimStepRequest(learning_rate=1e-3))).optimizer_steps == 1
    assert service.get(info.id).optimizer.learning_rate == 1e-3  # an override stays
    ended = await service.close(info.id)
    assert ended.status == "ended" and trainer.commands[-1] == "session_close"
    with pytest.raises(NotFound):
        service.get(info.id)
    assert (await service.open(OpenSessionRequest(model="m"))).model == "m"  # the model is free again


async def test_a_call_that_waited_while_the_session_ended_is_a_404(
        sessions: tuple[TrainingSessions, StandInTrainer]) -> None:
    service, trainer = sessions
    info = await service.open(OpenSessionRequest(model="m"))
    trainer.gate = asyncio.Event()
    first = asyncio.create_task(service.forward_backward(info.id, BATCH))
    await asyncio.sleep(0.01)
    waiting = asyncio.create_task(service.forward_backward(info.id, BATCH))
    closing = asyncio.create_task(service.close(info.id))
    await asyncio.sleep(0.01)
    trainer.gate.set()
    assert (await first).pending_passes == 1
    await closing
    with pytest.raises(NotFound, match="ended while this call waited"):
        await waiting


async def test_a_session_that_ends_is_there_until_its_model_is_free(
        sessions: tuple[TrainingSessions, StandInTrainer]) -> None:
    """The reaper's end, interleaved with callers: while the worker drops the session it is still there (not a
    404 beside a held model); whoever gets the 404 can open the next session at once."""
    service, trainer = sessions
    info = await service.open(OpenSessionRequest(model="m", idle_timeout_s=5))
    service._sessions[info.id].last_used_at = time.time() - 6
    trainer.gate, trainer.arrived = asyncio.Event(), asyncio.Event()
    reaping = asyncio.create_task(service.reap_idle())
    await trainer.arrived.wait()  # the worker is dropping the session now
    assert trainer.commands == ["session_open"] and service.get(info.id).status == "open"
    assert service.open_models() == {"m": info.id}

    async def reopen_on_404(call: Any) -> str:
        """A caller that sees the 404 opens a new session in the same step, before anything else runs."""
        try:
            await call
        except NotFound:
            service.training.reserve_for_session("m", "next")  # 409 if the model were still held
            service.training.release_session("m")
            return "reopened"
        return "answered"

    waiting = asyncio.create_task(reopen_on_404(service.forward_backward(info.id, BATCH)))
    closing = asyncio.create_task(reopen_on_404(service.close(info.id)))  # a second close, as a client's DELETE
    for _ in range(3):  # let both reach their wait (on the lock, on the end)
        await asyncio.sleep(0)
    assert not waiting.done() and not closing.done()
    trainer.gate.set()
    await reaping
    assert await waiting == "reopened" and await closing == "reopened"
    assert trainer.commands == ["session_open", "session_close"]  # dropped once, and nothing ran on it after its end began
    with pytest.raises(NotFound):
        service.get(info.id)
    assert (await service.open(OpenSessionRequest(model="m"))).model == "m"


async def test_a_session_lost_while_its_end_waited_is_not_closed_again(
        sessions: tuple[TrainingSessions, StandInTrainer]) -> None:
    """The worker's close is keyed by model: once the session is lost, the model may hold the next session."""
    service, trainer = sessions
    info = await service.open(OpenSessionRequest(model="m"))
    trainer.gate, trainer.arrived = asyncio.Event(), asyncio.Event()
    passing = asyncio.create_task(service.forward_backward(info.id, BATCH))
    await trainer.arrived.wait()
    closing = asyncio.create_task(service.close(info.id))  # waits for the pass
    trainer.fail_with = "SessionError"  # the worker no longer knows the session
    trainer.gate.set()
    with pytest.raises(Conflict) as lost:
        await passing
    assert lost.value.code == "session_lost" and (await closing).status == "ended"
    assert trainer.commands == ["session_open", "pass"]
    assert (await service.open(OpenSessionRequest(model="m"))).model == "m"


async def test_a_restarted_trainer_loses_the_session_and_frees_the_model(
        sessions: tuple[TrainingSessions, StandInTrainer]) -> None:
    service, trainer = sessions
    info = await service.open(OpenSessionRequest(model="m"))
    trainer.pid = 101  # the worker crashed and a new one started
    with pytest.raises(Conflict) as lost:
        await service.forward_backward(info.id, BATCH)
    assert lost.value.code == "session_lost"
    with pytest.raises(NotFound):
        service.get(info.id)
    await service.open(OpenSessionRequest(model="m"))


async def test_idle_sessions_end(sessions: tuple[TrainingSessions, StandInTrainer]) -> None:
    service, _ = sessions
    info = await service.open(OpenSessionRequest(model="m", idle_timeout_s=5))
    await service.reap_idle()
    service.get(info.id)  # not idle yet
    service._sessions[info.id].last_used_at = time.time() - 6
    await service.reap_idle()
    with pytest.raises(NotFound):
        service.get(info.id)


async def test_a_reward_model_has_no_training_session(sessions: tuple[TrainingSessions, StandInTrainer]) -> None:
    service, trainer = sessions
    service.store.create("rm", "base", LoraConfig(), kind="reward", reward_head=RewardHeadConfig())
    with pytest.raises(InvalidRequest) as refused:
        await service.open(OpenSessionRequest(model="rm"))
    assert refused.value.code == "wrong_model_kind" and trainer.commands == []


async def test_a_pass_over_built_sequences_takes_the_same_path(sessions: tuple[TrainingSessions, StandInTrainer]) -> None:
    service, trainer = sessions
    info = await service.open(OpenSessionRequest(model="m"))
    datum = TrainSequence([5, 6, 7, 8], [False, True, True, True], [0.0, -1.0, -2.0, -3.0], 0.0,
                          token_advantages=[0.0, 0.5, -1.0, 2.0])
    config = TinkerLossConfig(loss_fn="ppo")
    result = await service.run_sequences(info.id, [datum], config, backward=True)
    assert result.pending_passes == 1 and result.sequences[0].logprobs == [None, -1.0, -2.0, -3.0]
    sent_config, sent = trainer.batches[-1]
    assert sent_config == config and sent[0].token_advantages == [0.0, 0.5, -1.0, 2.0]
    assert (await service.run_sequences(info.id, [datum], config, backward=False)).pending_passes == 1  # forward
    trainer.fail_with = "BatchError"
    with pytest.raises(InvalidRequest):
        await service.run_sequences(info.id, [datum], config, backward=True)
    too_long = TrainSequence([5] * 5000, [False] + [True] * 4999, [0.0] * 5000, 0.0, token_advantages=[0.0] * 5000)
    with pytest.raises(InvalidRequest) as refused:
        await service.run_sequences(info.id, [too_long], config, backward=True)
    assert refused.value.code == "sequence_too_long"
    assert (await service.forward_backward(info.id, BATCH)).pending_passes == 2  # the same count
    assert len(trainer.batches) == 3 and trainer.batches[-1][1][0].token_advantages is None
