"""`art.TrainingSession`: low-level training primitives for your own loop (the AITraining / Tinker style).

    async with await model.training_session(learning_rate=1e-4) as session:
        result = await session.forward_backward(sequences, loss="importance_sampling")
        await session.optim_step()
        saved = await session.save_state()           # a new step, served as saved.model ("name@N")

Every method has a `_sync` variant (generated: `_syncify`), and the compute methods (`forward_backward`, `forward`, `optim_step`)
an `_async` one that returns an `asyncio.Task` at once: tasks of one session reach the server in the order
they were made, so a loop can queue its next forward_backward while the current one runs.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterable, Mapping
from types import TracebackType
from typing import Any, TypeVar

from pydantic import BaseModel

from ._backend import Backend
from ._errors import NotFoundError
from ._http import Connection
from ._syncify import in_sync_call, run_sync, syncify
from ._trajectory import Trajectory
from .session_types import (
    AdamParams,
    ForwardRequest,
    LossName,
    OpenSessionRequest,
    OptimStepRequest,
    OptimStepResult,
    PassResult,
    RecordedSequence,
    SavedState,
    SessionInfo,
    SessionSequence,
)

_T = TypeVar("_T")
_M = TypeVar("_M", bound=BaseModel)

SequenceLike = SessionSequence | Mapping[str, Any]
"""`{"token_ids": [...], "trainable"?: [...], "logprobs"?: [...], "advantage"?: 0.0, "pair"?, "preference"?}`."""
TrajectoryLike = RecordedSequence | Mapping[str, Any] | tuple[Trajectory, float]
"""A recorded trajectory with its advantage: `(trajectory, advantage)` or `{"trajectory_id", "advantage"}`."""


class TrainingSession:
    """An open training session on one model (see the module docstring); make it with
    `await model.training_session(...)` or `model.training_session_sync(...)`."""

    def __init__(self, connection: Connection, info: SessionInfo) -> None:
        self._backend = Backend(connection)
        self.info = info
        self._tail: asyncio.Future[Any] | None = None  # the last queued `_async` task

    @property
    def id(self) -> str:
        return self.info.id

    @classmethod
    def _open_request(cls, model: str, from_step: int | None, optimizer: AdamParams | Mapping[str, Any] | None,
                      idle_timeout_s: float, options: dict[str, Any]) -> dict[str, Any]:
        params = AdamParams.model_validate({**(dict(optimizer) if isinstance(optimizer, Mapping)
                                               else optimizer.model_dump() if optimizer else {}), **options})
        return OpenSessionRequest(model=model, from_step=from_step, optimizer=params,
                                  idle_timeout_s=idle_timeout_s).model_dump(mode="json")

    @classmethod
    async def open(cls, connection: Connection, model: str, *, from_step: int | None = None,
                   optimizer: AdamParams | Mapping[str, Any] | None = None, idle_timeout_s: float = 600.0,
                   **options: Any) -> TrainingSession:
        body = cls._open_request(model, from_step, optimizer, idle_timeout_s, options)
        return cls(connection, await Backend(connection).open_session(body))

    @classmethod
    def open_sync(cls, connection: Connection, model: str, *, from_step: int | None = None,
                  optimizer: AdamParams | Mapping[str, Any] | None = None, idle_timeout_s: float = 600.0,
                  **options: Any) -> TrainingSession:
        """`open` for sync code."""
        return run_sync(cls.open(connection, model, from_step=from_step, optimizer=optimizer,
                                 idle_timeout_s=idle_timeout_s, **options))

    # ------------------------------------------------------------------------------ primitives

    async def forward_backward(self, sequences: Iterable[SequenceLike] = (), *,
                               trajectories: Iterable[TrajectoryLike] = (), loss: LossName = "cross_entropy",
                               **loss_config: Any) -> PassResult:
        """Run `loss` over the batch and add its gradients to the session's (until `optim_step`). `loss_config`
        holds the fields of the loss's objective config (`epsilon_high=0.28`, `beta=0.1`, `kl_beta`, ...)."""
        body = _pass_body(sequences, trajectories, loss, loss_config)
        return await self._post("forward_backward", body, PassResult)

    def forward_backward_async(self, sequences: Iterable[SequenceLike] = (), *,
                               trajectories: Iterable[TrajectoryLike] = (), loss: LossName = "cross_entropy",
                               **loss_config: Any) -> asyncio.Task[PassResult]:
        body = _pass_body(sequences, trajectories, loss, loss_config)
        return self._queue(lambda: self._post("forward_backward", body, PassResult))

    async def forward(self, sequences: Iterable[SequenceLike] = (), *, trajectories: Iterable[TrajectoryLike] = (),
                      loss: LossName = "cross_entropy", **loss_config: Any) -> PassResult:
        """The model's logprobs of the batch's scored tokens (and the loss), without gradient."""
        return await self._post("forward", _pass_body(sequences, trajectories, loss, loss_config), PassResult)

    def forward_async(self, sequences: Iterable[SequenceLike] = (), *, trajectories: Iterable[TrajectoryLike] = (),
                      loss: LossName = "cross_entropy", **loss_config: Any) -> asyncio.Task[PassResult]:
        body = _pass_body(sequences, trajectories, loss, loss_config)
        return self._queue(lambda: self._post("forward", body, PassResult))

    async def optim_step(self, **overrides: Any) -> OptimStepResult:
        """Apply the accumulated gradients (AdamW, clipped at `max_grad_norm`) and clear them; `overrides`
        (`learning_rate`, `betas`, `eps`, `weight_decay`, `max_grad_norm`) stay in effect for later steps."""
        return await self._post("optim_step", _optim_body(overrides), OptimStepResult)

    def optim_step_async(self, **overrides: Any) -> asyncio.Task[OptimStepResult]:
        body = _optim_body(overrides)
        return self._queue(lambda: self._post("optim_step", body, OptimStepResult))

    async def save_state(self, *, serve: bool = True) -> SavedState:
        """The adapter and optimizer state as the model's next step; sample from `result.model` ("name@N")."""
        await self._drain()
        return await self._post("save_state", {"serve": serve}, SavedState)

    async def load_state(self, step: int, *, optimizer: bool = True) -> SessionInfo:
        """Continue from a saved step: its adapter, and its optimizer state when it has one (`optimizer=False`:
        a fresh optimizer on those weights); drops pending gradients."""
        await self._drain()
        self.info = await self._post("load_state", {"step": step, "optimizer": optimizer}, SessionInfo)
        return self.info

    async def refresh(self) -> SessionInfo:
        self.info = await self._backend.get_session(self.id)
        return self.info

    async def close(self) -> SessionInfo:
        """End the session (pending gradients are dropped; saved steps stay)."""
        await self._drain()
        self.info = await self._backend.close_session(self.id)
        return self.info

    forward_backward_sync = syncify(forward_backward)
    forward_sync = syncify(forward)
    optim_step_sync = syncify(optim_step)
    save_state_sync = syncify(save_state)
    load_state_sync = syncify(load_state)
    close_sync = syncify(close)

    async def __aenter__(self) -> TrainingSession:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self.info.status == "open":
            with contextlib.suppress(NotFoundError):  # it ended on the server already (timed out, lost, restarted)
                await self.close()

    def __enter__(self) -> TrainingSession:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.info.status == "open":
            with contextlib.suppress(NotFoundError):  # it ended on the server already
                self.close_sync()

    def __repr__(self) -> str:
        return f"TrainingSession({self.id!r}, model={self.info.model!r}, step={self.info.step})"

    # ------------------------------------------------------------------------------- internals

    async def _post(self, action: str, body: dict[str, Any], result: type[_M]) -> _M:
        return await self._backend.session_action(self.id, action, body, result)

    def _queue(self, call: Callable[[], Awaitable[_T]]) -> asyncio.Task[_T]:
        """Start `call` after every task queued before it has finished (whatever their outcome)."""
        previous = self._tail

        async def run() -> _T:
            if previous is not None:
                await asyncio.wait([previous])
            return await call()

        task = asyncio.ensure_future(run())
        self._tail = task
        return task

    async def _drain(self) -> None:
        """Wait for the queued `_async` tasks. A `_sync` call runs on a loop of its own and cannot wait for
        tasks of the caller's loop, so it goes ahead without them."""
        if self._tail is not None and not in_sync_call():
            await asyncio.wait([self._tail])


def _sequence(value: SequenceLike) -> dict[str, Any]:
    sequence = value if isinstance(value, SessionSequence) else SessionSequence.model_validate(dict(value))
    return sequence.model_dump(mode="json", exclude_none=True)


def _trajectory(value: TrajectoryLike) -> dict[str, Any]:
    if isinstance(value, tuple):
        trajectory, advantage = value
        if trajectory.failed or not trajectory.recorded:
            raise ValueError(f"{trajectory!r} is not a recorded trajectory that completed")
        value = RecordedSequence(trajectory_id=trajectory.id, advantage=advantage)
    recorded = value if isinstance(value, RecordedSequence) else RecordedSequence.model_validate(dict(value))
    return recorded.model_dump(mode="json")


def _pass_body(sequences: Iterable[SequenceLike], trajectories: Iterable[TrajectoryLike], loss: LossName,
               loss_config: dict[str, Any]) -> dict[str, Any]:
    """The request body, validated here (pydantic ValidationError) before anything is sent."""
    request = ForwardRequest.model_validate({"sequences": [_sequence(s) for s in sequences],
                                             "trajectories": [_trajectory(t) for t in trajectories],
                                             "loss": loss, "loss_config": loss_config})
    request.config()  # a bad loss_config fails here, not on the server
    return request.model_dump(mode="json", exclude_none=True)


def _optim_body(overrides: dict[str, Any]) -> dict[str, Any]:
    return OptimStepRequest.model_validate(overrides).model_dump(mode="json", exclude_none=True)
