"""The OpenAI surface's logic: forward to vLLM, rewrite what comes back, record trajectory completions.

No FastAPI here: `OpenAIServing` takes raw request bytes and returns response bytes or a `ProxyStream`,
and raises the typed errors of `artlike_server.errors`. `api_router` is the thin HTTP glue. This module
checks and forwards; its concerns live beside it: `rewriting` (the body sent upstream, the answer sent
back), `recording` (trajectory completions into the log), `streaming` (SSE through `ProxyStream`).

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
import time
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from typing import Any, Protocol

import orjson

from artlike.types import TrajectoryRecord, is_valid_trajectory_id
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
from artlike_server.openai_api.dialects import Dialect, Translation
from artlike_server.openai_api.protocol import (
    Endpoint,
    ModelCard,
    ModelList,
    RecordedEndpoint,
    validate_request,
)
from artlike_server.openai_api.recording import (
    CompletionLogLike,
    CompletionRecorder,
    CompletionTrace,
    MetricsLike,
    RecordContext,
)
from artlike_server.openai_api.request_caps import check_request_size
from artlike_server.openai_api.rewriting import prepare_upstream_body, rewrite_response
from artlike_server.openai_api.streaming import ProxyStream, usage_tokens

ENGINE_PATHS: dict[Endpoint, str] = {
    "chat.completions": "/v1/chat/completions",
    "completions": "/v1/completions",
}


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
        self.recorder = CompletionRecorder(log, metrics)

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
                    self.recorder,
                    self.metrics,
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
            if (usage := usage_tokens(payload.get("usage"))) is not None:
                self.metrics.tokens(label, *usage)
            if context is not None:
                trace = CompletionTrace(endpoint)
                trace.add(payload)
                await self.recorder.record(trace, context)
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
