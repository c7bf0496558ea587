"""The `/_train_model` NDJSON stream on the client: lines → typed events → a `TrainResult`.

Stream rules, enforced here:
- one JSON object per line, with a `type`; blank lines are ignored;
- an `error` line raises `TrainingError` with the server's code and message;
- the stream ends with a `done` line; a stream that ends without one raises `TrainingError`
  (code "stream_incomplete");
- a `type` this client does not know (a newer server) is yielded as `UnknownEvent` and otherwise
  ignored, so an older client keeps working; a known type that fails validation is an error.
"""

from __future__ import annotations

import statistics
import warnings
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Generator, Iterable
from contextlib import aclosing
from typing import Any, get_args

import orjson
from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError
from tqdm.auto import tqdm

from ._errors import TrainingError
from ._trajectory import Trajectory, TrajectoryGroup
from .types import (
    STREAM_VERSION,
    DoneEvent,
    ErrorEvent,
    PPOConfig,
    StartEvent,
    StatusEvent,
    StepEvent,
    TrainConfig,
    TrainEvent,
    TrainGroup,
    TrainRequest,
)

__all__ = ["NoSignalWarning", "TrainResult", "TrainStream", "UnknownEvent", "parse_event"]

# Seconds without any line before the client gives up; the server sends a heartbeat every 10 s.
DEFAULT_IDLE_TIMEOUT = 120.0


class NoSignalWarning(UserWarning):
    """`model.train(...)` trained nothing: every group's rewards were equal (the served step stays)."""


def skipped_step_line(model: str, step: int, reason: str) -> str:
    """The `done` line of a step the server refused for lack of signal, so a training loop goes on."""
    warnings.warn(f"{model}: nothing trained, step {step} stays served: {reason}", NoSignalWarning, stacklevel=4)
    return DoneEvent(model=f"{model}@{step}", step=step, adapter_path=None, train_seconds=0.0, swap_seconds=0.0,
                     trained=False, reason=reason).model_dump_json()


class UnknownEvent(BaseModel):
    """An event of a type this client version does not know; its fields are kept as extra attributes."""

    model_config = ConfigDict(extra="allow")
    type: str


AnyEvent = TrainEvent | UnknownEvent
_EVENT_ADAPTER: TypeAdapter[TrainEvent] = TypeAdapter(TrainEvent)
_KNOWN_TYPES = frozenset(cls.model_fields["type"].default for cls in get_args(get_args(TrainEvent)[0]))


class TrainResult(BaseModel):
    """The outcome of one `model.train(...)`: the new step and what happened on the way."""

    step: int  # the step now served under the model's name
    model: str  # its exact served name, "name@step"
    metrics: list[StepEvent]  # one per gradient step
    start: StartEvent | None  # None when the server found nothing to train before starting
    done: DoneEvent

    @property
    def trained(self) -> bool:
        """False when the server trained nothing (`done.reason` says why, e.g. every group had equal rewards)."""
        return self.done.trained

    @property
    def objective_metrics(self) -> dict[str, float]:
        """The objective's own statistics (`StepEvent.metrics`), each the mean over the gradient steps that
        reported it."""
        names = sorted({name for step in self.metrics for name in step.metrics})
        return {name: statistics.fmean(step.metrics[name] for step in self.metrics if name in step.metrics)
                for name in names}


def parse_event(line: str | bytes) -> AnyEvent:
    """One NDJSON line as a typed event. Raises `TrainingError` (code "invalid_stream") for a bad line."""
    try:
        data = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise TrainingError(f"the train stream sent a line that is not JSON: {line[:200]!r}", code="invalid_stream") from exc
    if not isinstance(data, dict) or not isinstance(data.get("type"), str):
        raise TrainingError(f"the train stream sent a line without a 'type': {line[:200]!r}", code="invalid_stream")
    if data["type"] not in _KNOWN_TYPES:
        return UnknownEvent.model_validate(data)
    try:
        return _EVENT_ADAPTER.validate_python(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"][1:]) or data["type"]
        raise TrainingError(
            f"the train stream sent an invalid {data['type']!r} event ({where}: {first['msg']}): {line[:300]!r}",
            code="invalid_stream",
        ) from exc


class _EventDecoder:
    """Applies the stream rules (module docstring) line by line."""

    def __init__(self) -> None:
        self.finished = False

    def feed(self, line: str) -> AnyEvent | None:
        if not line.strip():
            return None
        event = parse_event(line)
        if isinstance(event, ErrorEvent):
            raise TrainingError.from_event(event)
        if isinstance(event, StartEvent) and event.version > STREAM_VERSION:
            warnings.warn(
                f"the server's train stream is version {event.version}, this client knows {STREAM_VERSION}: "
                "upgrade artlike to see every field",
                stacklevel=2,
            )
        self.finished = isinstance(event, DoneEvent)
        return event

    def end(self) -> None:
        if not self.finished:
            raise TrainingError(
                "the train stream ended without a 'done' line; the server may still finish the step "
                "(check model.get_step())",
                code="stream_incomplete",
            )


async def iter_events(lines: AsyncGenerator[str, None]) -> AsyncIterator[AnyEvent]:
    decoder = _EventDecoder()
    async with aclosing(lines):  # closes the HTTP stream as soon as `done` arrives
        async for line in lines:
            event = decoder.feed(line)
            if event is not None:
                yield event
            if decoder.finished:
                return
    decoder.end()


class _ResultBuilder:
    def __init__(self) -> None:
        self.start: StartEvent | None = None
        self.steps: list[StepEvent] = []
        self.done: DoneEvent | None = None

    def add(self, event: AnyEvent) -> None:
        if isinstance(event, StartEvent):
            self.start = event
        elif isinstance(event, StepEvent):
            self.steps.append(event)
        elif isinstance(event, DoneEvent):
            self.done = event

    def result(self) -> TrainResult:
        assert self.done is not None, "the event readers raise before a stream without 'done' gets here"
        return TrainResult(step=self.done.step, model=self.done.model, metrics=self.steps, start=self.start, done=self.done)


class TrainProgress:
    """A progress bar over gradient steps: loss and grad norm after each step, the stage in between."""

    def __init__(self, model: str, *, enabled: bool) -> None:
        self.bar = tqdm(desc=f"train {model}", unit="step", disable=not enabled)
        self.postfix: dict[str, str] = {}

    def update(self, event: AnyEvent) -> None:
        if isinstance(event, StartEvent):
            self.bar.reset(total=event.num_gradient_steps)
            self.bar.set_description(f"train {event.model} step {event.from_step}→{event.from_step + 1}")
            self.postfix = {"reward": f"{event.reward_mean:.3f}"} if event.reward_mean is not None else {}
            if event.groups_skipped:
                self.postfix["skipped_groups"] = f"{event.groups_skipped}/{event.groups}"
        elif isinstance(event, StatusEvent):
            self.postfix["stage"] = event.stage
        elif isinstance(event, StepEvent):
            self.postfix |= {"loss": f"{event.loss:.4g}", "grad_norm": f"{event.grad_norm:.3g}"}
            self.postfix.pop("stage", None)
            self.bar.update(1)
        elif isinstance(event, DoneEvent):
            self.postfix["stage"] = f"serving {event.model}" if event.trained else f"not trained: {event.reason}"
        self.bar.set_postfix(self.postfix)

    def close(self) -> None:
        self.bar.close()


def build_train_request(model: str, groups: Iterable[TrajectoryGroup | Iterable[Trajectory]], config: TrainConfig) -> TrainRequest:
    """The request body. Failed trajectories are left out; a group left empty is dropped (see `_gather`).

    Raises ValueError before any request when a group still has un-awaited rollouts, a trajectory has no
    reward (allowed when a PPO config names a `reward_model`: it scores the trajectory), or nothing is left to
    train on.
    """
    scored_by_a_model = isinstance(config, PPOConfig) and config.reward_model is not None
    wire_groups: list[TrainGroup] = []
    failed = 0
    for group in groups:
        if isinstance(group, TrajectoryGroup) and group.pending:
            raise ValueError(
                f"{group!r} has rollouts that were never awaited: pass the groups through "
                "art.gather_trajectory_groups(...) first"
            )
        members = list(group)
        usable = [trajectory for trajectory in members if not trajectory.failed]
        failed += len(members) - len(usable)
        if usable:
            wire_groups.append(TrainGroup(trajectories=[trajectory._to_wire(reward_required=not scored_by_a_model)
                                                        for trajectory in usable]))
    if not wire_groups:
        reason = f" (all {failed} trajectories failed)" if failed else ""
        raise ValueError(f"nothing to train on: no group has a trajectory that did not fail{reason}")
    return TrainRequest(model=model, groups=wire_groups, config=config)


class TrainStream:
    """What `model.train(...)` returns: iterate it for events, or await it for the `TrainResult`.

        async for event in model.train(groups):   # StartEvent, StatusEvent, StepEvent..., DoneEvent
            print(event)
        result = await model.train(groups)         # with a progress bar

    Nothing is sent until it is iterated or awaited, and it can be consumed once.
    """

    def __init__(self, lines: Callable[[], AsyncGenerator[str, None]], *, model: str, progress: bool) -> None:
        self._lines = lines
        self._model = model
        self._progress = progress
        self._consumed = False

    def __aiter__(self) -> AsyncIterator[AnyEvent]:
        self._claim()
        return iter_events(self._lines())

    def __await__(self) -> Generator[Any, None, TrainResult]:
        return self._collect(None).__await__()

    def _collect(self, on_event: Callable[[AnyEvent], None] | None) -> Coroutine[Any, Any, TrainResult]:
        """The step's result (what awaiting gives), with `on_event` seeing every event (the `_sync` variants)."""
        self._claim()
        return self._run(on_event)

    async def _run(self, on_event: Callable[[AnyEvent], None] | None) -> TrainResult:
        builder = _ResultBuilder()
        progress = TrainProgress(self._model, enabled=self._progress)
        try:
            async for event in iter_events(self._lines()):
                builder.add(event)
                progress.update(event)
                if on_event is not None:
                    on_event(event)
        finally:
            progress.close()
        return builder.result()

    def _claim(self) -> None:
        if self._consumed:
            raise RuntimeError("a TrainStream can be consumed once: call model.train(...) again for another step")
        self._consumed = True

    def __del__(self) -> None:
        if not self._consumed:
            warnings.warn("model.train(...) was never awaited or iterated: nothing was trained", RuntimeWarning, stacklevel=1)
