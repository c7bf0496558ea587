"""How the client's requests travel: client construction, auth, timeouts, retries, transports. Which routes
it calls, with which bodies, is `_backend.Backend`'s part.

Retries: 502/503/504 answers and connections that never reached the server are retried with exponential
backoff (honouring Retry-After); read errors after the request went out are retried only for idempotent
requests. Everything else maps to a typed error from `_errors`.
"""

from __future__ import annotations

import asyncio
import random
import ssl
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import httpx
import orjson

from ._errors import APIConnectionError, APITimeoutError, error_from_response, parse_retry_after
from ._syncify import in_sync_call
from ._version import __version__

__all__ = ["RetryPolicy"]

DEFAULT_TIMEOUT = httpx.Timeout(60.0, connect=10.0)
RETRY_STATUSES = frozenset({502, 503, 504})
IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})
# Failures where the request provably never reached the server: safe to retry for any method.
_NOT_SENT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


@dataclass(frozen=True)
class Multipart:
    """A multipart/form-data body: plain fields, and files as {name: (filename, bytes)}."""

    fields: dict[str, str]
    files: dict[str, tuple[str, bytes]]


@dataclass(frozen=True)
class RetryPolicy:
    """How transient failures are retried. `sleep`/`sync_sleep` are injectable so tests do not wait.

    Delay before retry n (0-based): the server's Retry-After when it sent one (capped at
    `max_retry_after`), else `min(max_backoff, initial_backoff * 2**n)` shortened by up to `jitter`
    (a fraction) so that many rollouts failing together do not come back together.
    """

    max_retries: int = 3
    initial_backoff: float = 0.5
    max_backoff: float = 8.0
    max_retry_after: float = 60.0
    jitter: float = 0.25
    sleep: Callable[[float], Awaitable[None]] = field(default=asyncio.sleep, repr=False)
    sync_sleep: Callable[[float], None] = field(default=time.sleep, repr=False)

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        if not 0.0 <= self.jitter < 1.0:
            raise ValueError("jitter must be in [0, 1)")

    def delay(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return min(retry_after, self.max_retry_after)
        backoff = min(self.max_backoff, self.initial_backoff * 2.0**attempt)
        return backoff * (1.0 - self.jitter * random.random())


def _retry_delay_for_response(policy: RetryPolicy, attempt: int, response: httpx.Response) -> float | None:
    """Seconds to wait before trying again, or None: this answer is final."""
    if response.status_code not in RETRY_STATUSES or attempt >= policy.max_retries:
        return None
    return policy.delay(attempt, parse_retry_after(response.headers.get("retry-after")))


def _retry_delay_for_error(
    policy: RetryPolicy, attempt: int, error: httpx.TransportError, idempotent: bool
) -> float | None:
    if attempt >= policy.max_retries or not (idempotent or isinstance(error, _NOT_SENT_ERRORS)):
        return None
    return policy.delay(attempt, None)


def _connection_error(error: httpx.TransportError, request: httpx.Request) -> APIConnectionError:
    kind = APITimeoutError if isinstance(error, httpx.TimeoutException) else APIConnectionError
    return kind(f"{request.method} {request.url}: {type(error).__name__}: {error or 'no details'}")


def _stream_error(error: httpx.TransportError, request: httpx.Request, idle_timeout: float) -> APIConnectionError:
    if isinstance(error, httpx.TimeoutException):
        return APITimeoutError(
            f"{request.method} {request.url}: no line for {idle_timeout:g} s (the server sends a heartbeat "
            "every few seconds); the server may still finish the job"
        )
    return APIConnectionError(
        f"{request.method} {request.url}: the stream broke ({type(error).__name__}: {error or 'no details'}); "
        "the server may still finish the job"
    )


class Connection:
    """How to reach one server: base URL, API key, timeouts, retry policy and transports.

    Each call opens its own short-lived client: async connections belong to the event loop that opened
    them, so a pooled one breaks scripts that call `asyncio.run` more than once (and every sync call runs
    on a loop of its own, see `_syncify`). These calls are a few per training step (rollout traffic goes
    through the trajectories' OpenAI clients), and the shared SSL context keeps a client cheap to build.
    A sync call sends through `sync_transport` and waits between retries with the policy's `sync_sleep`.
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout: httpx.Timeout = DEFAULT_TIMEOUT,
        retry: RetryPolicy | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        sync_transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        self._transport = transport
        # httpx.MockTransport serves both kinds: let one injected transport cover the sync API too.
        if sync_transport is None and isinstance(transport, httpx.BaseTransport):
            sync_transport = transport
        self._sync_transport = sync_transport

    @property
    def headers(self) -> dict[str, str]:
        headers = {"User-Agent": f"artlike-python/{__version__}"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    @cached_property
    def ssl_context(self) -> ssl.SSLContext:
        """Built once: creating a context is costly, and every trajectory's openai client needs one."""
        return httpx.create_ssl_context()

    def _client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.base_url, headers=self.headers, timeout=self.timeout, transport=self._chosen_transport(),
            verify=self.ssl_context,
        )

    def _chosen_transport(self) -> httpx.AsyncBaseTransport | None:
        if not in_sync_call():
            return self._transport
        if self._sync_transport is None or isinstance(self._sync_transport, httpx.AsyncBaseTransport):
            return self._sync_transport
        return _BlockingTransport(self._sync_transport)

    async def _wait(self, delay: float) -> None:
        if in_sync_call():
            self.retry.sync_sleep(delay)  # blocks only the sync call's own loop, as a sync client would
        else:
            await self.retry.sleep(delay)

    async def request(
        self, method: str, path: str, *, json: Any = None, params: dict[str, Any] | None = None,
        idempotent: bool | None = None, request_timeout: httpx.Timeout | None = None,
        multipart: Multipart | None = None,
    ) -> httpx.Response:
        """Send, retrying transient failures; the body is read. Raises a typed error for error statuses."""
        async with self.stream(method, path, json=json, params=params, idempotent=idempotent,
                               request_timeout=request_timeout, multipart=multipart) as response:
            await response.aread()
        return response

    @asynccontextmanager
    async def stream(
        self, method: str, path: str, *, json: Any = None, params: dict[str, Any] | None = None,
        idempotent: bool | None = None, request_timeout: httpx.Timeout | None = None,
        multipart: Multipart | None = None,
    ) -> AsyncIterator[httpx.Response]:
        """An open, successful (2xx) response whose body is not read yet; closed on exit."""
        async with self._client() as client:
            request = self._build(client, method, path, json, params, request_timeout, multipart)
            retry_any_read = method in IDEMPOTENT_METHODS if idempotent is None else idempotent
            attempt = 0
            while True:
                try:
                    response = await client.send(request, stream=True)
                except httpx.TransportError as error:
                    delay = _retry_delay_for_error(self.retry, attempt, error, retry_any_read)
                    if delay is None:
                        raise _connection_error(error, request) from error
                else:
                    delay = _retry_delay_for_response(self.retry, attempt, response)
                    if delay is None:
                        break
                    await response.aclose()
                await self._wait(delay)
                attempt += 1
            try:
                if response.is_error:
                    await response.aread()
                    raise error_from_response(response)
                yield response
            finally:
                await response.aclose()

    async def stream_lines(
        self, method: str, path: str, *, json: Any = None, idle_timeout: float, params: dict[str, Any] | None = None,
    ) -> AsyncGenerator[str, None]:
        """The lines of a long streamed answer; `idle_timeout` bounds the wait for each line."""
        async with self.stream(method, path, json=json, params=params,
                               request_timeout=self._streaming_timeout(idle_timeout)) as response:
            lines = response.aiter_lines()
            while True:
                try:
                    line = await anext(lines)
                except StopAsyncIteration:
                    return
                except httpx.TransportError as error:
                    raise _stream_error(error, response.request, idle_timeout) from error
                yield line

    def close(self) -> None:
        """Close an injected sync-only transport; every call opens and closes its own client."""
        if self._sync_transport is not None and not isinstance(self._sync_transport, httpx.AsyncBaseTransport):
            self._sync_transport.close()

    # ------------------------------------------------------------------------------------------ shared

    def _streaming_timeout(self, idle_timeout: float) -> httpx.Timeout:
        """The client's timeouts, but wait up to `idle_timeout` for each line of a long stream."""
        base = self.timeout
        return httpx.Timeout(connect=base.connect, read=idle_timeout, write=base.write, pool=base.pool)

    @staticmethod
    def _build(
        client: httpx.AsyncClient, method: str, path: str, json: Any,
        params: dict[str, Any] | None, timeout: httpx.Timeout | None, multipart: Multipart | None = None,
    ) -> httpx.Request:
        if multipart is not None:  # file uploads: httpx writes the multipart body
            return client.build_request(method, path, data=multipart.fields, files=multipart.files, params=params,
                                        timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT)
        # orjson: fast, and it serialises what pydantic's model_dump(mode="json") produces.
        content = None if json is None else orjson.dumps(json)
        headers = None if content is None else {"Content-Type": "application/json"}
        return client.build_request(
            method, path, content=content, params=params, headers=headers,
            timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
        )


class _BlockingTransport(httpx.AsyncBaseTransport):
    """A sync-only transport (`sync_transport=`) behind the async client of a sync call: it blocks that
    call's private loop while it works, as it would block a sync client's thread."""

    def __init__(self, transport: httpx.BaseTransport) -> None:
        self._transport = transport

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = self._transport.handle_request(request)
        return httpx.Response(response.status_code, headers=response.headers,
                              stream=_BlockingStream(response.stream), extensions=response.extensions)

    async def aclose(self) -> None:
        """Kept open: the transport is the caller's, shared by every sync call (`Connection.close` closes it)."""


class _BlockingStream(httpx.AsyncByteStream):
    def __init__(self, stream: httpx.SyncByteStream | httpx.AsyncByteStream) -> None:
        self._stream = stream

    async def __aiter__(self) -> AsyncIterator[bytes]:
        assert isinstance(self._stream, httpx.SyncByteStream), "a sync transport answers with a sync stream"
        for chunk in self._stream:
            yield chunk

    async def aclose(self) -> None:
        if isinstance(self._stream, httpx.SyncByteStream):
            self._stream.close()
