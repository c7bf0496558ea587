"""The OpenAI surface's logic: forward to vLLM, rewrite what comes back, record trajectory completions.

No FastAPI here: `OpenAIServing` takes raw request bytes and returns response bytes or a `ProxyStream`,
and raises the typed errors of `artlike_server.errors`. `api_router` is the thin HTTP glue.

What happens to a completion request
1. The body is parsed (orjson) and the fields the proxy relies on are checked (`protocol`): 400 naming the
   parameter. A trajectory id in the URL is checked against its pattern first.
   Policies: `seed` -> 400 when `settings.reject_seed` (a per-request seed can crash vLLM-CPU); on
   trajectory URLs `use_beam_search` (not samples of the policy) and completions `echo` (see below) -> 400
   `unsupported_parameter`; `n` over `settings.max_recorded_choices` -> 400 naming `n` (each choice is a
   log row; the body is stored once).
   On every route, a request whose answer may exceed `settings.max_request_tokens` token entries
   (n × max_tokens × (1 + top_logprobs), `request_caps`) -> 400 `request_too_large`.
2. The engine must be ready, else 503 with Retry-After. `model` is resolved and leased from the model
   manager (`name` -> `name@latest`, `name@N`, the base model id; unknown -> 404): the adapter stays loaded
   until the answer is complete, stream included.
3. The forwarded body is the caller's body with `model` set to the served engine name, plus what the proxy
   needs (`prepare_upstream_body`): on trajectory URLs `logprobs` and `return_token_ids` (and
   `include_reasoning`, whose absence hides token ids); on every stream `stream_options.include_usage` (the
   token metrics come from usage).
4. The response is vLLM's JSON rewritten in place (`rewrite_response` / `rewrite_chunk`), never re-validated:
   what the proxy forced and the caller did not ask for is removed (`logprobs` becomes null as in the
   OpenAI schema, `token_ids`/`prompt_token_ids`, the usage chunk), vLLM-only fields are dropped when null
   (`prompt_logprobs`, `prompt_text`, `stop_reason`, `routed_experts`, `kv_transfer_params`, ...), stream
   chunks left empty are dropped, and `model` is the exact served name: `name@N` tells the caller which step
   answered (like OpenAI answering `gpt-4o` with `gpt-4o-2024-08-06`).
5. On trajectory URLs every choice becomes one row of the completion log (`CompletionTrace`). The row is
   committed before the response (or the stream's `[DONE]`) is sent, so a client that trains right after
   its last completion finds it. A completion that cannot be recorded is an error for the caller (500, or
   an SSE error event in place of `[DONE]`): an RL run must not train on trajectories silently missing turns.

Measured on vLLM-CPU 0.32 (SmolLM2-135M, float32), which the log relies on:
- `token_ids` and `logprobs.content` are aligned 1:1 and both include the EOS token (`<|im_end|>`, id 2)
  when finish_reason is "stop"; with a stop string, both include the tokens of the stop string although
  the text excludes it; streaming and non-streaming give the same ids and logprobs. The log stores them as
  they are (the trainer masks nothing from the sampled span: EOS is a sampled token too) and refuses a
  choice whose lengths differ.
- Completions with `echo` and `return_token_ids` lose the echoed prompt text (vLLM treats the prompt ids as
  the echo), so `echo` is rejected on trajectory URLs rather than silently changed.

Streams: SSE events are split from the raw bytes, each JSON chunk rewritten and re-encoded (orjson, a few
µs). When the client goes away, `ProxyStream.aclose()` drops the upstream connection, so vLLM aborts the
request, and records what was generated with finish_reason "abort" (choices with no token are skipped).

The engine is reached through `engine.upstream.Upstreams`: the engine pool (`engine/pool.py`: routing,
trajectory affinity, failover) over one aiohttp `Upstream` per engine (see there why not httpx). Unit tests
give it a fake vLLM that answers over real HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from artlike.types import TrajectoryRecord, is_valid_trajectory_id
from artlike_server.completion_log import NewCompletion
from artlike_server.engine.upstream import EngineAnswer, EngineConnectionError, Upstreams
from artlike_server.errors import (
    APIError,
    Conflict,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    ServiceUnavailable,
    Unauthorized,
)
from artlike_server.openai_api.dialects import Dialect, StreamEncoder, Translation
from artlike_server.openai_api.protocol import (
    Endpoint,
    ModelCard,
    ModelList,
    RecordedEndpoint,
    validate_request,
)
from artlike_server.openai_api.request_caps import check_request_size

logger = logging.getLogger(__name__)

ENGINE_PATHS: dict[Endpoint, str] = {
    "chat.completions": "/v1/chat/completions",
    "completions": "/v1/completions",
}
ABORTED = "abort"
"""finish_reason recorded for a choice whose stream ended early (client gone, engine gone, engine error)."""

_SSE_DONE = b"data: [DONE]"

# vLLM-only response fields dropped when they are null (noise for an OpenAI client); the proxy-forced ones
# (token ids, logprobs) are handled by `_strip_*` according to what the caller asked for.
_NULL_EXTRAS_TOP = ("prompt_logprobs", "prompt_text", "kv_transfer_params", "ec_transfer_params", "metrics")
_NULL_EXTRAS_CHOICE = ("stop_reason", "routed_experts", "prompt_logprobs")
# vLLM sends these as null; the OpenAI schema allows them absent, not null (array / object).
_NULL_NOT_ALLOWED_MESSAGE = ("annotations", "function_call")
_NULL_NOT_ALLOWED_USAGE = ("completion_tokens_details", "prompt_tokens_details")


# ------------------------------------------------------------------------------------- collaborators


class EngineLike(Protocol):
    @property
    def state(self) -> str: ...

    def retry_after(self) -> float: ...


class ServedModelLike(Protocol):
    @property
    def engine_name(self) -> str: ...

    @property
    def step(self) -> int | None: ...


class ModelResolver(Protocol):
    def lease(self, requested: str) -> AbstractAsyncContextManager[ServedModelLike]:
        """Resolve `requested` and keep its adapter loaded until the context exits (404 if unknown)."""
        ...

    async def served_model_ids(self) -> list[str]: ...


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


class SettingsLike(Protocol):
    @property
    def reject_seed(self) -> bool: ...

    @property
    def max_recorded_choices(self) -> int: ...

    @property
    def max_request_tokens(self) -> int: ...

    @property
    def max_model_len(self) -> int | None: ...


# ------------------------------------------------------------------------------------------- errors


class RecordingFailed(APIError):
    """The completion was generated but could not be recorded in the trajectory's log."""

    status_code = 500
    error_type = "server_error"


class LogprobAlignmentError(ValueError):
    """A choice's token ids and sampling logprobs differ in length (or a logprob is missing)."""


def check_trajectory_id(trajectory_id: str) -> None:
    if not is_valid_trajectory_id(trajectory_id):
        raise InvalidRequest(
            "invalid trajectory id: 1-128 characters of letters, digits, '_' and '-', starting with a letter or digit",
            param="trajectory_id",
            code="invalid_trajectory_id",
        )


_ENGINE_ERRORS: dict[int, type[APIError]] = {
    400: InvalidRequest,
    401: Unauthorized,
    404: NotFound,
    409: Conflict,
    413: PayloadTooLarge,
}


def engine_error(status: int, content: bytes, *, retry_after: float) -> APIError:
    """vLLM's error response (`{"error": {"message", "type", "param", "code": <int>}}`) in OpenAI shape."""
    message, param = f"the engine answered HTTP {status}", None
    if content:
        try:
            parsed = orjson.loads(content)
        except orjson.JSONDecodeError:
            parsed = None
        error = parsed.get("error") if isinstance(parsed, dict) else None
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            message = error["message"]
            param = error["param"] if isinstance(error.get("param"), str) else None
        else:
            message = f"{message}: {content[:1000].decode(errors='replace')}"
    if status == 503:
        return ServiceUnavailable(message, retry_after=retry_after)
    kind = _ENGINE_ERRORS.get(status)
    if kind is not None:
        return kind(message, param=param)
    result = APIError(message, param=param)
    result.status_code = status
    if status < 500:
        result.error_type = "invalid_request_error"
    return result


# -------------------------------------------------------------------------------- request rewriting


@dataclass(frozen=True, slots=True)
class CallerAsked:
    """Which of the fields the proxy may force into a response the caller asked for itself."""

    logprobs: bool = False
    token_ids: bool = False
    prompt_logprobs: bool = False
    prompt_text: bool = False
    reasoning: bool = True
    usage: bool = False


def prepare_upstream_body(
    endpoint: Endpoint, body: dict[str, Any], engine_name: str, *, record: bool
) -> tuple[dict[str, Any], CallerAsked]:
    """The body to send to vLLM, and what the caller asked for (to strip the rest from the answer).

    >>> prepare_upstream_body("chat.completions", {"model": "m", "messages": []}, "m@3", record=True)[0]
    {'model': 'm@3', 'messages': [], 'return_token_ids': True, 'logprobs': True}
    """
    stream_options = body.get("stream_options") or {}
    asked = CallerAsked(
        logprobs=bool(body.get("logprobs"))
        if endpoint == "chat.completions"
        else body.get("logprobs") is not None,
        token_ids=bool(body.get("return_token_ids")),
        prompt_logprobs=body.get("prompt_logprobs") is not None,
        prompt_text=bool(body.get("return_prompt_text")),
        reasoning=body.get("include_reasoning") is not False,
        usage=bool(stream_options.get("include_usage")),
    )
    upstream = dict(body)
    upstream["model"] = engine_name
    if body.get("stream"):
        upstream["stream_options"] = {**stream_options, "include_usage": True}
    if record:
        upstream["return_token_ids"] = True
        if endpoint == "chat.completions":
            upstream["logprobs"] = True
            if not asked.reasoning:
                upstream["include_reasoning"] = True  # vLLM hides token ids along with the reasoning
        elif not asked.logprobs:
            upstream["logprobs"] = 0  # completions: the sampled token's logprob, no alternatives
    return upstream, asked


# ------------------------------------------------------------------------------- response rewriting


def _strip_top(payload: dict[str, Any], asked: CallerAsked) -> None:
    for key in _NULL_EXTRAS_TOP:
        if key in payload and payload[key] is None:
            del payload[key]
    if not asked.token_ids:
        payload.pop("prompt_token_ids", None)
    if not asked.prompt_logprobs:
        payload.pop("prompt_logprobs", None)
    if not asked.prompt_text:
        payload.pop("prompt_text", None)


def _strip_choice(choice: dict[str, Any], asked: CallerAsked) -> None:
    for key in _NULL_EXTRAS_CHOICE:
        if key in choice and choice[key] is None:
            del choice[key]
    if not asked.token_ids:
        choice.pop("token_ids", None)
        choice.pop("prompt_token_ids", None)
    elif "prompt_token_ids" in choice and choice["prompt_token_ids"] is None:
        del choice["prompt_token_ids"]
    if not asked.prompt_logprobs:
        choice.pop("prompt_logprobs", None)
    if not asked.logprobs and "logprobs" in choice:
        choice["logprobs"] = None
    message = choice.get("message") or choice.get("delta")
    logprobs = choice.get("logprobs")
    is_chat = "message" in choice or "delta" in choice
    if is_chat and isinstance(logprobs, dict) and "refusal" not in logprobs:
        logprobs["refusal"] = None  # the OpenAI schema requires it in a chat choice's logprobs (null: none)
    if message and "reasoning" in message and (message["reasoning"] is None or not asked.reasoning):
        del message["reasoning"]


def rewrite_response(payload: dict[str, Any], asked: CallerAsked, served_name: str) -> None:
    """Rewrite a non-streaming vLLM response in place for the caller."""
    payload["model"] = served_name
    _strip_top(payload, asked)
    _drop_nulls(payload.get("usage"), _NULL_NOT_ALLOWED_USAGE)
    for choice in payload.get("choices") or ():
        _strip_choice(choice, asked)
        _drop_nulls(choice.get("message"), _NULL_NOT_ALLOWED_MESSAGE)


def _drop_nulls(part: Any, keys: tuple[str, ...]) -> None:
    if isinstance(part, dict):
        for key in keys:
            if key in part and part[key] is None:
                del part[key]


def _says_nothing(choice: dict[str, Any]) -> bool:
    """A chunk choice that only carried forced fields: vLLM would not have sent it."""
    if choice.get("finish_reason") is not None or choice.get("logprobs") is not None:
        return False
    if "delta" in choice:
        return not choice["delta"]
    return not choice.get("text")


def rewrite_chunk(chunk: dict[str, Any], asked: CallerAsked, served_name: str) -> bool:
    """Rewrite one stream chunk in place; False when nothing is left for the caller (drop the event)."""
    choices = chunk.get("choices")
    if choices is None:
        return True  # an in-stream error event: passed through as vLLM sent it
    chunk["model"] = served_name
    _strip_top(chunk, asked)
    if not asked.usage:
        if not choices:
            return False  # the forced usage-only chunk
        chunk.pop("usage", None)
    if not choices:
        return True
    for choice in choices:
        _strip_choice(choice, asked)
    kept = [choice for choice in choices if not _says_nothing(choice)]
    if len(kept) != len(choices):
        chunk["choices"] = kept
    return bool(kept) or "usage" in chunk


# ------------------------------------------------------------------------------------ recording


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


def _usage_tokens(usage: Any) -> tuple[int, int] | None:
    if not isinstance(usage, dict):
        return None
    return int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)


# --------------------------------------------------------------------------------------- streaming


def split_sse_events(buffer: bytearray, data: bytes) -> list[bytes]:
    """Append `data` to `buffer` and pop every complete SSE event (without its blank-line terminator)."""
    buffer += data
    events: list[bytes] = []
    start = 0
    while (end := buffer.find(b"\n\n", start)) != -1:
        events.append(bytes(buffer[start:end]))
        start = end + 2
    del buffer[:start]
    return events


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


class ProxyStream:
    """An SSE stream from vLLM, rewritten chunk by chunk, recorded when it ends.

    Iterate it for the bytes to send. Whoever sends them must call `aclose()` once when done, shielded from
    cancellation: if the stream did not finish (client gone), that drops the upstream connection so vLLM
    aborts the generation, and queues the partial completion for the log.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        serving: OpenAIServing,
        upstream: EngineAnswer,
        *,
        endpoint: Endpoint,
        asked: CallerAsked,
        served_name: str,
        started: float,
        context: RecordContext | None,
        lease: AsyncExitStack,
        encoder: StreamEncoder | None = None,
        metrics_label: str | None = None,
    ) -> None:
        self._serving = serving
        self._lease = lease
        self._upstream = upstream
        self._endpoint = endpoint
        self._encoder = encoder  # None: the chunks go out as chat/completions SSE, as vLLM sent them
        self._metrics_label = metrics_label or endpoint
        self._asked = asked
        self._served_name = served_name
        self._started = started
        self._context = context
        self._trace = CompletionTrace(endpoint)
        self._iterator: AsyncGenerator[bytes, None] | None = None
        self._first_chunk_seen = False
        self._finished = False  # the upstream stream was fully handled (recorded, if recording)
        self._closed = False

    def __aiter__(self) -> AsyncIterator[bytes]:
        if self._iterator is None:
            self._iterator = self._events()
        return self._iterator

    async def _events(self) -> AsyncGenerator[bytes, None]:
        buffer = bytearray()
        saw_done = False
        try:
            async for data in self._upstream.iter_chunks():
                out: list[bytes] = []
                for event in split_sse_events(buffer, data):
                    if event.startswith(_SSE_DONE):
                        saw_done = True  # held back until the completion is recorded
                        continue
                    rewritten = self._rewrite_event(event)
                    if rewritten is not None:
                        out.append(rewritten)
                if out:
                    yield b"".join(out)
        except EngineConnectionError as exc:
            # The engine went away mid-stream (crash, restart): record what was generated, tell the client.
            logger.warning("engine stream broke off: %s", exc)
            self._finished = True
            self._record_partial()
            yield self._error_event(ServiceUnavailable(f"the engine stopped mid-stream ({exc})"))
            return
        # Fully read: the connection is back in the pool. Recording submits its rows before its first await,
        # so a cancellation from here on cannot lose them.
        self._finished = True
        if self._context is not None:
            error = await self._record(aborted=not saw_done)
            if error is not None:
                yield self._error_event(error)
                return
        if saw_done:
            yield _SSE_DONE + b"\n\n" if self._encoder is None else await self._encoder.done()

    def _error_event(self, error: APIError) -> bytes:
        return _sse(error.body()) if self._encoder is None else self._encoder.error(error)

    def _rewrite_event(self, event: bytes) -> bytes | None:
        if not event.startswith(b"data: "):
            return event + b"\n\n"  # SSE comments and keep-alives pass through
        chunk = orjson.loads(event[6:])
        if not isinstance(chunk, dict):
            return event + b"\n\n"
        choices = chunk.get("choices")
        if choices and not self._first_chunk_seen:
            # vLLM sends its first chunk (the role) together with the first generated token
            self._first_chunk_seen = True
            self._serving.metrics.time_to_first_token(self._metrics_label, time.perf_counter() - self._started)
        if choices == [] and (usage := _usage_tokens(chunk.get("usage"))) is not None:
            self._serving.metrics.tokens(self._metrics_label, *usage)
        if self._context is not None:
            self._trace.add(chunk)
        if not rewrite_chunk(chunk, self._asked, self._served_name):
            return None
        if self._encoder is not None:
            return self._encoder.chunk(chunk) or None
        return _sse(chunk)

    async def _record(self, *, aborted: bool) -> APIError | None:
        assert self._context is not None
        try:
            rows = self._trace.records(self._context, aborted=aborted)
        except LogprobAlignmentError as exc:
            return self._serving.recording_failed("alignment", exc)
        try:
            await self._serving.log.record(rows)
        except Exception as exc:  # reported to the caller in-stream, counted and logged
            return self._serving.recording_failed("write", exc)
        self._serving.metrics.completions_recorded(len(rows))
        return None

    def _record_partial(self) -> None:
        """Queue what was generated without awaiting anything: the task may be cancelled."""
        if self._context is None:
            return
        try:
            rows = self._trace.records(self._context, aborted=True)
        except LogprobAlignmentError as exc:
            self._serving.recording_failed("alignment", exc)
            return
        if rows:
            self._serving.log.submit(rows).add_done_callback(self._serving.on_partial_recorded(len(rows)))

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._iterator is not None:
            await self._iterator.aclose()
        if not self._finished:
            self._finished = True
            self._record_partial()
            self._upstream.abort()  # drops the connection mid-body: vLLM aborts the request
        await self._lease.aclose()


# ----------------------------------------------------------------------------------------- serving


class OpenAIServing:
    """Serves the OpenAI endpoints against one engine; built per request from the app's shared objects."""

    def __init__(
        self,
        *,
        engine: EngineLike,
        upstream: Upstreams,
        models: ModelResolver,
        log: CompletionLogLike,
        metrics: MetricsLike,
        settings: SettingsLike,
    ) -> None:
        self.engine = engine
        self.upstream = upstream
        self.models = models
        self.log = log
        self.metrics = metrics
        self.settings = settings

    # ----------------------------------------------------------------------------------- completions

    async def create_completion(
        self, endpoint: Endpoint, raw_body: bytes, trajectory_id: str | None = None
    ) -> bytes | ProxyStream:
        """Forward one chat completion or completion; record it when `trajectory_id` is given.

        Returns the response body (JSON bytes) or a `ProxyStream` for `stream: true`.
        """
        started, created_at = time.perf_counter(), time.time()
        if trajectory_id is not None:
            check_trajectory_id(trajectory_id)
        body = parse_json_object(raw_body)
        return await self._forward(
            endpoint, body, raw_body, trajectory_id, started=started, created_at=created_at, translation=None
        )

    async def create_translated(
        self, dialect: Dialect, raw_body: bytes, trajectory_id: str | None = None
    ) -> bytes | ProxyStream:
        """Serve a request of another API (Responses, Anthropic Messages) as a chat completion.

        The dialect turns the caller's body into a chat completions body and the (rewritten) chat answer back
        into its own shape; recording, leases and errors are the chat path's. Recorded rows keep the caller's
        body and the dialect's endpoint name.
        """
        started, created_at = time.perf_counter(), time.time()
        if trajectory_id is not None:
            check_trajectory_id(trajectory_id)
        translation = await dialect.translate(parse_json_object(raw_body))
        return await self._forward(
            "chat.completions",
            translation.chat_body,
            raw_body,
            trajectory_id,
            started=started,
            created_at=created_at,
            translation=translation,
            recorded_as=dialect.endpoint,
        )

    async def _forward(
        self,
        endpoint: Endpoint,
        body: dict[str, Any],
        raw_body: bytes,
        trajectory_id: str | None,
        *,
        started: float,
        created_at: float,
        translation: Translation | None,
        recorded_as: RecordedEndpoint | None = None,
    ) -> bytes | ProxyStream:
        request = validate_request(endpoint, body)
        # Before any engine work: the answer's size is bounded by what the request asks for.
        check_request_size(endpoint, body, limit=self.settings.max_request_tokens,
                           max_model_len=self.settings.max_model_len, dialect=recorded_as)
        self._check_policies(endpoint, body, recording=trajectory_id is not None)
        self._check_engine_ready()
        label = recorded_as or endpoint
        # The lease keeps the served adapter loaded until the answer is complete (stream included), so
        # an in-flight request finishes on the step it started with.
        lease = AsyncExitStack()
        served = await lease.enter_async_context(self.models.lease(request.model))
        try:
            upstream_body, asked = prepare_upstream_body(
                endpoint, body, served.engine_name, record=trajectory_id is not None
            )
            context = None
            if trajectory_id is not None:
                context = RecordContext(
                    trajectory_id=trajectory_id,
                    endpoint=label,
                    requested_model=request.model,
                    served_model=served.engine_name,
                    step=served.step,
                    request=raw_body,
                    created_at=created_at,
                    started=started,
                )
            # A trajectory's turns stay on one engine (its prefix cache); a non-streamed answer may be sent
            # again to another engine if the first one breaks off (nothing has reached the client yet).
            upstream = await self._send(ENGINE_PATHS[endpoint], orjson.dumps(upstream_body),
                                        affinity=trajectory_id, replayable=not request.stream,
                                        model=served.engine_name)
            if request.stream:
                return ProxyStream(
                    self,
                    upstream,
                    endpoint=endpoint,
                    asked=asked,
                    served_name=served.engine_name,
                    started=started,
                    context=context,
                    lease=lease.pop_all(),
                    encoder=translation.stream(served.engine_name) if translation is not None else None,
                    metrics_label=label,
                )
            payload = orjson.loads(await self._read(upstream))
            if (usage := _usage_tokens(payload.get("usage"))) is not None:
                self.metrics.tokens(label, *usage)
            if context is not None:
                trace = CompletionTrace(endpoint)
                trace.add(payload)
                await self._record(trace, context)
            rewrite_response(payload, asked, served.engine_name)
            if translation is not None:
                return orjson.dumps(await translation.response(payload, served.engine_name))
            return orjson.dumps(payload)
        finally:
            await lease.aclose()  # a no-op once a stream took the lease over

    async def _send(self, path: str, body: bytes, *, affinity: str | None, replayable: bool,
                    model: str | None = None) -> EngineAnswer:
        """Send to the engine; transport failures are 503, engine errors come back in OpenAI shape."""
        try:
            response = await self.upstream.post(path, body, affinity=affinity, replayable=replayable, model=model)
        except EngineConnectionError as exc:
            raise ServiceUnavailable(
                f"{exc}; retry shortly", retry_after=self.engine.retry_after()
            ) from exc
        if response.status != 200:
            content = await self._read(response)
            raise engine_error(response.status, content, retry_after=self.engine.retry_after())
        return response

    async def _read(self, response: EngineAnswer) -> bytes:
        try:
            return await response.read()
        except EngineConnectionError as exc:
            raise ServiceUnavailable(
                f"the engine failed mid-answer ({exc})", retry_after=self.engine.retry_after()
            ) from exc

    def _check_engine_ready(self) -> None:
        state = str(self.engine.state)
        if state != "ready":
            raise ServiceUnavailable(
                f"the engine is {state}; retry shortly",
                retry_after=self.engine.retry_after(),
                code=f"engine_{state}",
            )

    def _check_policies(self, endpoint: Endpoint, body: dict[str, Any], *, recording: bool) -> None:
        if self.settings.reject_seed and body.get("seed") is not None:
            raise InvalidRequest(
                "seed is not supported by this server: on the CPU engine (vLLM-CPU 0.32) a per-request seed can "
                "crash the engine for every request (RuntimeError: CPU Generator does not use offset). "
                "Omit seed; sampling stays random per request.",
                param="seed",
                code="unsupported_parameter",
            )
        if not recording:
            return
        n = body.get("n")
        if isinstance(n, int) and n > self.settings.max_recorded_choices:
            raise InvalidRequest(
                f"n={n} is over this server's limit of {self.settings.max_recorded_choices} choices per recorded "
                "request (--max-recorded-choices); send several requests instead",
                param="n",
                code="too_many_choices",
            )
        if body.get("use_beam_search"):
            raise InvalidRequest(
                "use_beam_search is not supported through a trajectory URL: beam search does not sample from "
                "the policy, so its tokens cannot be trained on as samples",
                param="use_beam_search",
                code="unsupported_parameter",
            )
        if endpoint == "completions" and body.get("echo"):
            raise InvalidRequest(
                "echo is not supported through a trajectory URL: the engine cannot echo the prompt while "
                "returning the token ids the trajectory records",
                param="echo",
                code="unsupported_parameter",
            )

    async def _record(self, trace: CompletionTrace, context: RecordContext) -> None:
        try:
            rows = trace.records(context)
        except LogprobAlignmentError as exc:
            raise self.recording_failed("alignment", exc) from exc
        try:
            await self.log.record(rows)
        except Exception as exc:
            raise self.recording_failed("write", exc) from exc
        self.metrics.completions_recorded(len(rows))

    def recording_failed(self, reason: str, exc: BaseException) -> RecordingFailed:
        logger.error("completion not recorded (%s): %r", reason, exc)
        self.metrics.completion_log_failed(reason)
        return RecordingFailed(
            f"the completion was generated but could not be recorded ({reason}: {exc})",
            code="completion_not_recorded",
        )

    def on_partial_recorded(self, rows: int) -> Any:
        def done(future: Any) -> None:
            error = future.exception()
            if error is not None:
                self.recording_failed("write", error)
            else:
                self.metrics.completions_recorded(rows)

        return done

    # ----------------------------------------------------------------------------------- other routes

    async def list_models(self, trajectory_id: str | None = None) -> bytes:
        if trajectory_id is not None:
            check_trajectory_id(trajectory_id)
        created = int(time.time())
        ids = await self.models.served_model_ids()
        return (
            ModelList(data=[ModelCard(id=model_id, created=created) for model_id in ids])
            .model_dump_json()
            .encode()
        )

    async def get_trajectory(self, trajectory_id: str) -> bytes:
        check_trajectory_id(trajectory_id)
        completions = await self.log.get(trajectory_id)
        if not completions:
            raise NotFound(
                f"no completions recorded for trajectory {trajectory_id!r}",
                param="trajectory_id",
                code="trajectory_not_found",
            )
        # Off the event loop: a long trajectory's JSON is megabytes.
        return await asyncio.to_thread(_trajectory_json, trajectory_id, completions)

    async def delete_trajectory(self, trajectory_id: str) -> None:
        """Delete a trajectory's recorded completions (404 when it has none)."""
        check_trajectory_id(trajectory_id)
        if not await self.log.delete_trajectory(trajectory_id):
            raise NotFound(
                f"no completions recorded for trajectory {trajectory_id!r}",
                param="trajectory_id",
                code="trajectory_not_found",
            )


def _trajectory_json(trajectory_id: str, completions: list[Any]) -> bytes:
    return TrajectoryRecord(trajectory_id=trajectory_id, completions=completions).model_dump_json().encode()


def parse_json_object(raw_body: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw_body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object", code="invalid_json")
    return body
