"""Recording a trajectory's completions: every choice becomes one row of the completion log.

`CompletionTrace` collects token ids and sampling logprobs per choice, from one response or from stream
chunks; `CompletionRecorder` writes its rows (before the answer, or the stream's `[DONE]`, is sent, so a
client that trains right after its last completion finds it) and turns a failure into `RecordingFailed`:
an RL run must not train on trajectories silently missing turns.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from artlike_server.completion_log import NewCompletion
from artlike_server.errors import APIError
from artlike_server.openai_api.protocol import Endpoint, RecordedEndpoint

logger = logging.getLogger(__name__)

ABORTED = "abort"
"""finish_reason recorded for a choice whose stream ended early (client gone, engine gone, engine error)."""


class CompletionLogLike(Protocol):
    async def record(self, completions: Sequence[NewCompletion]) -> None: ...

    def submit(self, completions: Sequence[NewCompletion]) -> Any: ...

    async def get(self, trajectory_id: str) -> list[Any]: ...

    async def delete_trajectory(self, trajectory_id: str) -> int: ...


class MetricsLike(Protocol):
    def tokens(self, endpoint: str, prompt: int, completion: int) -> None: ...

    def time_to_first_token(self, endpoint: str, seconds: float) -> None: ...

    def completions_recorded(self, count: int) -> None: ...

    def completion_log_failed(self, reason: str, count: int = 1) -> None: ...


class RecordingFailed(APIError):
    """The completion was generated but could not be recorded in the trajectory's log."""

    status_code = 500
    error_type = "server_error"


class LogprobAlignmentError(ValueError):
    """A choice's token ids and sampling logprobs differ in length (or a logprob is missing)."""


def sampled_logprobs(endpoint: Endpoint, choice: dict[str, Any]) -> list[float | None]:
    """The logprob of each sampled token in a choice (or chunk choice), in order."""
    logprobs = choice.get("logprobs")
    if not logprobs:
        return []
    if endpoint == "chat.completions":
        return [entry["logprob"] for entry in logprobs.get("content") or ()]
    return list(logprobs.get("token_logprobs") or ())


def aligned_logprobs(token_ids: Sequence[int], logprobs: Sequence[float | None]) -> list[float]:
    """The logprobs of `token_ids`, one each; raise `LogprobAlignmentError` if they do not pair up 1:1."""
    if len(logprobs) != len(token_ids):
        raise LogprobAlignmentError(f"{len(token_ids)} output tokens but {len(logprobs)} sampling logprobs")
    result: list[float] = []
    for logprob in logprobs:
        if logprob is None:
            raise LogprobAlignmentError("a sampled token has no logprob")
        result.append(float(logprob))
    return result


@dataclass(slots=True)
class ChoiceTrace:
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass(frozen=True, slots=True)
class RecordContext:
    """Everything a completion log row needs besides what vLLM returns."""

    trajectory_id: str
    endpoint: RecordedEndpoint  # the route the caller used (a translated dialect records its own name)
    requested_model: str
    served_model: str
    step: int | None
    request: bytes  # the caller's body, as sent
    created_at: float
    started: float  # perf_counter at arrival, for latency


class CompletionTrace:
    """Collects token ids and sampling logprobs per choice, from one response or from stream chunks."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.request_id: str | None = None
        self.choices: dict[int, ChoiceTrace] = {}

    def add(self, payload: dict[str, Any]) -> None:
        """Take a whole response or one chunk (before it is rewritten for the caller)."""
        if self.request_id is None:
            self.request_id = payload.get("id")
        shared_prompt = payload.get("prompt_token_ids")  # chat: top level; completions: per choice
        for choice in payload.get("choices") or ():
            trace = self.choices.get(choice["index"])
            if trace is None:
                trace = self.choices[choice["index"]] = ChoiceTrace()
            if trace.prompt_token_ids is None:
                trace.prompt_token_ids = choice.get("prompt_token_ids") or shared_prompt
            token_ids = choice.get("token_ids")
            if token_ids:
                trace.token_ids.extend(token_ids)
            trace.logprobs.extend(sampled_logprobs(self.endpoint, choice))
            if choice.get("finish_reason") is not None:
                trace.finish_reason = choice["finish_reason"]

    def records(self, context: RecordContext, *, aborted: bool = False) -> list[NewCompletion]:
        """One row per choice. Finished: every choice must be complete and aligned (else raise).

        Aborted (stream cut short): choices that produced nothing are skipped, the others get "abort".
        """
        latency = time.perf_counter() - context.started
        rows: list[NewCompletion] = []
        for index in sorted(self.choices):
            trace = self.choices[index]
            finish_reason = trace.finish_reason
            if aborted:
                if finish_reason is None and not trace.token_ids:
                    continue
                finish_reason = finish_reason or ABORTED
            if trace.prompt_token_ids is None:
                raise LogprobAlignmentError(f"choice {index} came without prompt token ids")
            rows.append(
                NewCompletion(
                    trajectory_id=context.trajectory_id,
                    request_id=self.request_id or "",
                    choice_index=index,
                    endpoint=context.endpoint,
                    model=context.requested_model,
                    served_model=context.served_model,
                    step=context.step,
                    request=context.request,
                    prompt_token_ids=trace.prompt_token_ids,
                    output_token_ids=trace.token_ids,
                    logprobs=aligned_logprobs(trace.token_ids, trace.logprobs),
                    finish_reason=finish_reason,
                    created_at=context.created_at,
                    latency_seconds=latency,
                )
            )
        return rows


class CompletionRecorder:
    """Writes a trace's rows to the completion log, counting them; a failure is logged, counted and
    returned (or raised) as `RecordingFailed`."""

    def __init__(self, log: CompletionLogLike, metrics: MetricsLike) -> None:
        self.log = log
        self.metrics = metrics

    async def record(self, trace: CompletionTrace, context: RecordContext, *, aborted: bool = False) -> None:
        """Write the rows and wait for them; raises RecordingFailed."""
        try:
            rows = trace.records(context, aborted=aborted)
        except LogprobAlignmentError as exc:
            raise self.failed("alignment", exc) from exc
        try:
            await self.log.record(rows)
        except Exception as exc:
            raise self.failed("write", exc) from exc
        self.metrics.completions_recorded(len(rows))

    def submit_partial(self, trace: CompletionTrace, context: RecordContext) -> None:
        """Queue what a cut-short stream generated without awaiting anything: the task may be cancelled."""
        try:
            rows = trace.records(context, aborted=True)
        except LogprobAlignmentError as exc:
            self.failed("alignment", exc)
            return
        if rows:
            self.log.submit(rows).add_done_callback(self._on_partial_recorded(len(rows)))

    def failed(self, reason: str, exc: BaseException) -> RecordingFailed:
        logger.error("completion not recorded (%s): %r", reason, exc)
        self.metrics.completion_log_failed(reason)
        return RecordingFailed(
            f"the completion was generated but could not be recorded ({reason}: {exc})",
            code="completion_not_recorded",
        )

    def _on_partial_recorded(self, rows: int) -> Callable[[Any], None]:
        def done(future: Any) -> None:
            error = future.exception()
            if error is not None:
                self.failed("write", error)
            else:
                self.metrics.completions_recorded(rows)

        return done
