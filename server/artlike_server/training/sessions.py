"""Training sessions: the low-level primitives (forward_backward, optim_step, forward, save_state, load_state)
on one model's adapter, for people who write their own training loop (AITraining's and Tinker's users).

The service checks a request, builds its sequences (token-level, or recorded trajectories token-exact), hands
the worker one command at a time (`torch_worker/training_sessions.py` holds the gradients between commands) and turns a
saved state into a committed step through `ModelManager.commit_step`, as a job's step. Rules:
- one session per model, never beside a `/_train_model` job on it (`TrainingService.reserve_for_session`);
- a session unused for `idle_timeout_s` ends (`reap_idle`, from the app's background loop), as does every
  session when the server stops; its pending gradients are dropped, saved steps stay;
- a session lives in one trainer process: if the worker restarted (a crash), the session is lost (409
  `session_lost`) and the caller opens a new one from its last saved step;
- a session's end is one step as callers see it: it stays visible while the worker drops it, then it leaves
  the table in the same step the model is freed, so a caller that got the 404 can open the next one at once;
- a worker command runs to its end even when the HTTP caller goes away (shielded), so the worker's state
  always matches what the service believes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from artlike.session_types import (
    AdamParams,
    ForwardRequest,
    LoadStateRequest,
    OpenSessionRequest,
    OptimStepRequest,
    OptimStepResult,
    PassResult,
    SavedState,
    SaveStateRequest,
    SequenceResult,
    SessionInfo,
    SessionSequence,
)
from artlike.types import DPOConfig

from ..completion_log import CompletionLog, ReadLimitExceeded
from ..errors import Conflict, InvalidRequest, NotFound, ServiceUnavailable, validation_error
from ..models.manager import ModelManager, served_name
from ..models.store import ModelStore
from ..trainer_ipc import protocol
from ..trainer_ipc.batch_file import write_batch
from ..trainer_ipc.sequences import UNKNOWN_LOGPROB, TrainSequence, sequences_from_completions
from .job import TrainingService
from .trainer_client import TrainerCrashed, TrainerError, TrainerProcess, TrainerTimeout

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_CALLER_ERRORS = frozenset({"BatchError", "ValueError", "AdapterError", "NonFiniteGradient"})
"""Worker exceptions caused by what the caller sent (400), not by the trainer."""


@dataclass
class Session:
    id: str
    model: str
    step: int
    optimizer: AdamParams
    idle_timeout_s: float
    trainer_pid: int | None
    created_at: float = field(default_factory=time.time)
    last_used_at: float = field(default_factory=time.time)
    optimizer_steps: int = 0
    pending_passes: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    closing: bool = False  # its end has begun: no new command runs on it
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # set once it is gone and its model is free

    def info(self, status: Literal["open", "ended"] = "open") -> SessionInfo:
        return SessionInfo(id=self.id, model=self.model, step=self.step, created_at=self.created_at,
                           last_used_at=self.last_used_at, idle_timeout_s=self.idle_timeout_s,
                           optimizer=self.optimizer, optimizer_steps=self.optimizer_steps,
                           pending_passes=self.pending_passes, status=status)


class TrainingSessions:
    def __init__(self, store: ModelStore, models: ModelManager, completion_log: CompletionLog,
                 trainer: TrainerProcess, training: TrainingService) -> None:
        self.store = store
        self.models = models
        self.completion_log = completion_log
        self.trainer = trainer
        self.training = training
        self._sessions: dict[str, Session] = {}
        self._work_dir = store.root / ".sessions"

    # ------------------------------------------------------------------------------- lifecycle

    async def open(self, request: OpenSessionRequest) -> SessionInfo:
        if self.store.require(request.model).kind == "reward":  # the primitives' losses are a policy's
            raise InvalidRequest(f"{request.model!r} is a reward model; training sessions train policies (train a "
                                 "reward model with objective 'reward_model')", param="model", code="wrong_model_kind")
        step = request.from_step if request.from_step is not None else self.models.latest_step(request.model)
        if step is None or step not in self.store.committed_steps(request.model):
            raise NotFound(f"model {request.model!r} has no step {step}", param="from_step", code="step_not_found")
        session = Session(id=f"ts_{secrets.token_hex(12)}", model=request.model, step=step,
                          optimizer=request.optimizer, idle_timeout_s=request.idle_timeout_s, trainer_pid=None)
        self.training.reserve_for_session(request.model, session.id)
        try:
            await self._run(session, protocol.SessionOpen(
                model_name=request.model, adapter_dir=str(self.store.step_dir(request.model, step)),
                optimizer=request.optimizer))
        except BaseException:
            self.training.release_session(request.model)
            raise
        session.trainer_pid = self.trainer.pid
        self._sessions[session.id] = session
        log.info("training session %s opened on %s@%d", session.id, session.model, step)
        return session.info()

    def open_models(self) -> dict[str, str]:
        """model -> the id of the session open on it."""
        return {session.model: session.id for session in self._sessions.values()}

    def get(self, session_id: str) -> SessionInfo:
        return self._require(session_id).info()

    async def close(self, session_id: str, *, reason: str = "ended by its caller") -> SessionInfo:
        session = self._require(session_id)
        if session.closing:  # another caller (or the reaper) is ending it: answer once it is gone
            await session.ended.wait()
            raise _gone(session_id)
        session.closing = True
        return await self._shielded(self._end(session, reason))  # a caller that goes away leaves it half-ended

    async def _end(self, session: Session, reason: str) -> SessionInfo:
        try:
            async with session.lock:  # after the command in flight, if any
                lost = session.ended.is_set()  # that command lost it: the model may hold a new session now
                if not lost and self.trainer.pid == session.trainer_pid and self.trainer.is_running:
                    try:
                        await self._shielded(
                            self.trainer.session_command(protocol.SessionClose(model_name=session.model)))
                    except (TrainerError, TrainerCrashed, TrainerTimeout) as error:
                        log.warning("closing training session %s in the trainer failed: %s", session.id, error)
        finally:  # only now may a job or a new session use the model: the worker has dropped the session first
            self._forget(session)
        log.info("training session %s on %s closed: %s", session.id, session.model, reason)
        return session.info(status="ended")

    def _forget(self, session: Session) -> None:
        """Free the model and remove the session in one step (no await between): whoever sees it gone finds
        the model free. Once only: by then the model may hold a new session."""
        if session.ended.is_set():  # lost while its end waited for the command in flight
            return
        self.training.release_session(session.model)
        if self._sessions.get(session.id) is session:
            del self._sessions[session.id]
        session.ended.set()

    async def reap_idle(self) -> None:
        """End the sessions unused for longer than their idle timeout (called periodically)."""
        now = time.time()
        for session in list(self._sessions.values()):
            if session.closing or session.ended.is_set() or session.lock.locked():
                continue
            if now - session.last_used_at > session.idle_timeout_s:
                await self.close(session.id, reason=f"idle for over {session.idle_timeout_s:.0f} s")

    async def shutdown(self) -> None:
        for session_id in list(self._sessions):
            with contextlib.suppress(NotFound):  # ended meanwhile (a reaper's close that was under way)
                await self.close(session_id, reason="the server is stopping")

    # ------------------------------------------------------------------------------ primitives

    async def forward_backward(self, session_id: str, request: ForwardRequest, *, backward: bool = True
                               ) -> PassResult:
        session = self._require(session_id)
        config = _config_of(request)
        reference_dir = self.training.reference_step(session.model, config)
        async with self._using(session):
            sequences = await self._sequences(request, dpo=isinstance(config, DPOConfig))
            return await self._pass(session, sequences, config, reference_dir, backward=backward)

    async def run_sequences(self, session_id: str, sequences: list[TrainSequence],
                            config: protocol.PassConfig, *, backward: bool) -> PassResult:
        """A pass over sequences the caller built (a Tinker loss's carry `token_advantages`), checked against
        this server's limits as `forward_backward`'s are."""
        session = self._require(session_id)
        reference_dir = self.training.reference_step(session.model, config)
        _check_lengths(sequences, self.training.limits.max_sequence_tokens)
        if isinstance(config, DPOConfig):
            _check_pairs(sequences)
        async with self._using(session):
            return await self._pass(session, sequences, config, reference_dir, backward=backward)

    async def _pass(self, session: Session, sequences: list[TrainSequence], config: protocol.PassConfig,
                    reference_dir: Path | None, *, backward: bool) -> PassResult:
        """Write the batch, run the worker's pass on it, count it among the pending ones (under the session's lock)."""
        batch_path = await asyncio.to_thread(self._write_batch, sequences)
        try:
            done = await self._run(session, protocol.Pass(
                model_name=session.model, batch_path=str(batch_path), config=config, backward=backward,
                reference_adapter_dir=None if reference_dir is None else str(reference_dir)))
        finally:
            batch_path.unlink(missing_ok=True)
        assert isinstance(done, protocol.PassDone), done
        if backward:
            session.pending_passes += 1
        return PassResult(loss=done.loss, tokens=done.tokens, objective=done.objective, metrics=done.metrics,
                          sequences=[SequenceResult(logprobs=values) for values in done.logprobs],
                          pending_passes=session.pending_passes, seconds=round(done.seconds, 4))

    async def optim_step(self, session_id: str, request: OptimStepRequest) -> OptimStepResult:
        session = self._require(session_id)
        async with self._using(session):
            if session.pending_passes == 0:
                raise Conflict("no gradients to apply: call forward_backward first", code="no_gradients")
            overrides = request.model_dump(exclude_none=True)
            session.optimizer = session.optimizer.model_validate({**session.optimizer.model_dump(), **overrides})
            done = await self._run(session, protocol.OptimStep(model_name=session.model, optimizer=session.optimizer))
            assert isinstance(done, protocol.Optimized), done
            session.pending_passes = 0
            session.optimizer_steps += 1
            return OptimStepResult(grad_norm=done.grad_norm, optimizer_steps=session.optimizer_steps,
                                   learning_rate=session.optimizer.learning_rate, seconds=round(done.seconds, 4))

    async def save_state(self, session_id: str, request: SaveStateRequest) -> SavedState:
        session = self._require(session_id)
        async with self._using(session):
            started = time.perf_counter()
            staging = self.store.new_staging_dir(session.model)
            try:
                await self._run(session, protocol.SaveState(model_name=session.model, out_dir=str(staging)))
                committed = await self._shielded(self.models.commit_step(
                    session.model, staging, lambda step, swap: self._history_entry(session, step, swap),
                    load=request.serve))
            except BaseException:
                self.store.discard_staging(staging)
                raise
            session.step = committed.step
            return SavedState(model=served_name(session.model, committed.step), step=committed.step,
                              adapter_path=str(committed.adapter_path), served=request.serve,
                              seconds=round(time.perf_counter() - started, 4))

    async def load_state(self, session_id: str, request: LoadStateRequest) -> SessionInfo:
        session = self._require(session_id)
        async with self._using(session):
            if request.step not in self.store.committed_steps(session.model):
                raise NotFound(f"model {session.model!r} has no step {request.step}", param="step",
                               code="step_not_found")
            await self._run(session, protocol.SessionOpen(
                model_name=session.model, adapter_dir=str(self.store.step_dir(session.model, request.step)),
                optimizer=session.optimizer, fresh_optimizer=not request.optimizer))
            session.step, session.pending_passes = request.step, 0
            return session.info()

    # ------------------------------------------------------------------------------- internals

    def _require(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise _gone(session_id)
        return session

    def _using(self, session: Session) -> _SessionUse:
        return _SessionUse(session, lambda: self._sessions.get(session.id) is session and not session.closing)

    async def _run(self, session: Session, command: Any) -> protocol.WorkerEvent:
        """One worker command for `session`, mapped to HTTP errors; a restarted worker lost the session."""
        if session.trainer_pid is not None and session.trainer_pid != self.trainer.pid:
            await self._lose(session)
        try:
            return await self._shielded(self.trainer.session_command(command))
        except TrainerError as error:
            if error.kind in _CALLER_ERRORS:
                raise InvalidRequest(f"the trainer refused the batch: {error.message}", code="invalid_batch") from None
            if error.kind == "SessionError":
                await self._lose(session)
            raise
        except (TrainerCrashed, TrainerTimeout) as error:
            if session.trainer_pid is not None:
                await self._lose(session)
            raise ServiceUnavailable(f"the trainer is not available: {error}", retry_after=30.0,
                                     code="trainer_unavailable") from error

    async def _lose(self, session: Session) -> None:
        self._forget(session)
        raise Conflict(f"training session {session.id} was lost: the trainer restarted since it opened; open a "
                       f"new session from the last saved step ({session.model}@{session.step})",
                       code="session_lost")

    @staticmethod
    async def _shielded(work: Awaitable[_T]) -> _T:
        """Run `work` to its end even if the caller is cancelled (a client that went away)."""
        task = asyncio.ensure_future(work)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            await asyncio.wait([task])
            raise

    async def _sequences(self, request: ForwardRequest, *, dpo: bool) -> list[TrainSequence]:
        limits = self.training.limits
        sequences = [_token_sequence(s, dpo=dpo, index=i) for i, s in enumerate(request.sequences)]
        if request.trajectories:
            if dpo:
                raise InvalidRequest("the dpo loss takes token-level `sequences` with `pair` and `preference`",
                                     param="trajectories", code="invalid_batch")
            ids = [t.trajectory_id for t in request.trajectories]
            try:
                records = await self.completion_log.read_for_training(ids, max_records=limits.max_records,
                                                                      max_bytes=limits.max_bytes)
            except ReadLimitExceeded as error:
                raise InvalidRequest(str(error), param="trajectories", code="training_data_too_large") from None
            for index, trajectory in enumerate(request.trajectories):
                if not records.get(trajectory.trajectory_id):
                    raise NotFound(f"trajectory {trajectory.trajectory_id!r} has no recorded completions",
                                   param=f"trajectories[{index}]", code="trajectory_not_found")
                sequences.extend(sequences_from_completions(records[trajectory.trajectory_id], trajectory.advantage,
                                                            mask_truncated=False))
        _check_lengths(sequences, limits.max_sequence_tokens)
        if dpo:
            _check_pairs(sequences)
        return sequences

    def _write_batch(self, sequences: list[TrainSequence]) -> Path:
        self._work_dir.mkdir(parents=True, exist_ok=True)
        path = self._work_dir / f"{secrets.token_hex(8)}.batch"
        write_batch(path, sequences)
        return path

    def _history_entry(self, session: Session, step: int, swap_seconds: float) -> dict[str, Any]:
        return {"step": step, "from_step": session.step, "time": time.time(), "source": "training_session",
                "session": session.id, "optimizer_steps": session.optimizer_steps,
                "optimizer": session.optimizer.model_dump(), "swap_seconds": round(swap_seconds, 4)}


class _SessionUse:
    """`async with`: the session's commands in order, `last_used_at` refreshed before and after; a call that
    waited while the session was ended finds it gone (404), not half there, and only once its model is free."""

    def __init__(self, session: Session, still_open: Callable[[], bool]) -> None:
        self._session = session
        self._still_open = still_open

    async def __aenter__(self) -> None:
        await self._session.lock.acquire()
        if not self._still_open():
            self._session.lock.release()  # the ending close may be waiting for it
            await self._session.ended.wait()
            raise NotFound(f"training session {self._session.id!r} ended while this call waited", param="id",
                           code="session_not_found")
        self._session.last_used_at = time.time()

    async def __aexit__(self, *_: object) -> None:
        self._session.last_used_at = time.time()
        self._session.lock.release()


def _gone(session_id: str) -> NotFound:
    return NotFound(f"training session {session_id!r} does not exist (ended or timed out)", param="id",
                    code="session_not_found")


def _config_of(request: ForwardRequest) -> Any:
    try:
        return request.config()
    except ValidationError as error:  # named as the caller sent it: loss_config.<field>
        errors = [{**e, "loc": ("loss_config", *e.get("loc", ()))} for e in error.errors()]
        raise validation_error(RequestValidationError(errors)) from None


def _token_sequence(sequence: SessionSequence, *, dpo: bool, index: int) -> TrainSequence:
    n = len(sequence.token_ids)
    trainable = list(sequence.trainable) if sequence.trainable is not None else [False] + [True] * (n - 1)
    trainable[0] = False  # never a target: nothing precedes it
    given = sequence.logprobs if sequence.logprobs is not None else [None] * n
    behaviour = [(UNKNOWN_LOGPROB if value is None else value) if trained else 0.0
                 for value, trained in zip(given, trainable, strict=True)]
    preference = {"chosen": 1, "rejected": -1}.get(sequence.preference or "", 0) if dpo else 0
    if dpo and preference == 0:
        raise InvalidRequest(f"sequences[{index}] has no `pair` and `preference`, which the dpo loss needs",
                             param=f"sequences[{index}]", code="invalid_batch")
    return TrainSequence(list(sequence.token_ids), trainable, behaviour, sequence.advantage,
                         group_index=sequence.pair if sequence.pair is not None else 0, preference=preference)


def _check_lengths(sequences: list[TrainSequence], max_sequence_tokens: int) -> None:
    for index, sequence in enumerate(sequences):
        if sequence.num_tokens > max_sequence_tokens:
            raise InvalidRequest(f"sequence {index} has {sequence.num_tokens} tokens, over this server's limit "
                                 f"of {max_sequence_tokens}", param="sequences", code="sequence_too_long")


def _check_pairs(sequences: list[TrainSequence]) -> None:
    sides: dict[int, list[int]] = {}
    for sequence in sequences:
        sides.setdefault(sequence.group_index, []).append(sequence.preference)
    for pair, preferences in sides.items():
        if sorted(preferences) != [-1, 1]:
            raise InvalidRequest(f"pair {pair} needs exactly one chosen and one rejected sequence",
                                 param="sequences", code="invalid_batch")

