"""Streaming an answer: vLLM's SSE events split from the raw bytes, each JSON chunk rewritten for the
caller (`rewriting.rewrite_chunk`) or re-encoded by a dialect, the completion recorded when the stream ends.

When the client goes away, `ProxyStream.aclose()` drops the upstream connection, so vLLM aborts the
request, and queues what was generated for the log with finish_reason "abort".
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

import orjson

from artlike_server.engine.upstream import EngineAnswer, EngineConnectionError
from artlike_server.errors import APIError, ServiceUnavailable
from artlike_server.openai_api.dialects import StreamEncoder
from artlike_server.openai_api.protocol import Endpoint
from artlike_server.openai_api.recording import (
    CompletionRecorder,
    CompletionTrace,
    MetricsLike,
    RecordContext,
    RecordingFailed,
)
from artlike_server.openai_api.rewriting import CallerAsked, rewrite_chunk

logger = logging.getLogger(__name__)

SSE_DONE = b"data: [DONE]"


def usage_tokens(usage: Any) -> tuple[int, int] | None:
    if not isinstance(usage, dict):
        return None
    return int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)


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


def sse(payload: dict[str, Any]) -> bytes:
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
        recorder: CompletionRecorder,
        metrics: MetricsLike,
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
        self._recorder = recorder
        self._metrics = metrics
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
                    if event.startswith(SSE_DONE):
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
            yield SSE_DONE + b"\n\n" if self._encoder is None else await self._encoder.done()

    def _error_event(self, error: APIError) -> bytes:
        return sse(error.body()) if self._encoder is None else self._encoder.error(error)

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
            self._metrics.time_to_first_token(self._metrics_label, time.perf_counter() - self._started)
        if choices == [] and (usage := usage_tokens(chunk.get("usage"))) is not None:
            self._metrics.tokens(self._metrics_label, *usage)
        if self._context is not None:
            self._trace.add(chunk)
        if not rewrite_chunk(chunk, self._asked, self._served_name):
            return None
        if self._encoder is not None:
            return self._encoder.chunk(chunk) or None
        return sse(chunk)

    async def _record(self, *, aborted: bool) -> APIError | None:
        assert self._context is not None
        try:
            await self._recorder.record(self._trace, self._context, aborted=aborted)
        except RecordingFailed as error:  # reported to the caller in-stream (counted and logged already)
            return error
        return None

    def _record_partial(self) -> None:
        """Queue what was generated without awaiting anything: the task may be cancelled."""
        if self._context is not None:
            self._recorder.submit_partial(self._trace, self._context)

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
