"""The proxy's connection pool to the engine's completion endpoints: aiohttp, without the httpx layer.

Every chat completion and completion the proxy forwards goes through `Upstream.post`. Admin calls and
health checks use `EngineClient.http` (httpx); they are rare. Why a second client for the hot path:
httpx (over its aiohttp transport) costs several times the CPU per request of aiohttp alone, mostly in
building URLs, headers and cookie jars per request (bench/proxy_cpu.py measures the proxy's CPU). The
proxy shares its cores with vLLM, so its CPU per request is added latency and lost engine throughput.

    EngineConnectionError (EngineError)   connect refused, or the connection broke before the answer ended

A response is read whole (`read`) or as it arrives (`iter_chunks`); either returns the connection to the
pool once the body has ended. `abort()` closes the connection instead: vLLM sees the disconnect and aborts
the generation (what the proxy does when its own client goes away).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

import aiohttp
import yarl

from .errors import EngineError

_MAX_CONNECTIONS = 512  # well over 64 concurrent streams; admin calls have their own pool
# vLLM's uvicorn closes idle connections after 5 s (TIMEOUT_KEEP_ALIVE). Dropping ours first means a
# request never goes out on a connection the engine is closing at that very moment.
_KEEPALIVE_S = 4.0
# Generation legitimately takes minutes: no read timeout. A hung engine is the supervisor's to detect; when
# it restarts the engine, the dropped connection ends the request (EngineConnectionError -> 503).
# Only the TCP connect itself is bounded (`sock_connect`): aiohttp's `connect` also counts the wait for a
# free connection of the pool, so beyond _MAX_CONNECTIONS concurrent requests (many agent rollouts at once)
# the queued ones would fail as "unreachable" after 5 s although the engine is only busy.
_CONNECT_TIMEOUT_S = 5.0
_CONNECTION_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError)


class EngineConnectionError(EngineError):
    """The engine could not be reached, or the connection broke before its answer was complete."""


class EngineAnswer(Protocol):
    """One engine answer as the proxy reads it (`UpstreamResponse`, or the pool's wrappers of it)."""

    @property
    def status(self) -> int: ...

    async def read(self) -> bytes: ...

    def iter_chunks(self) -> AsyncIterator[bytes]: ...

    def abort(self) -> None: ...


class Upstreams(Protocol):
    """Where the proxy sends completions: one engine (`Upstream`) or a pool of them (`pool.EnginePool`).

    `affinity`: keep requests with this key on one engine (its prefix cache). `replayable`: the caller
    reads the whole body, so a pool may send it again elsewhere if the answer breaks off. `model`: the
    engine model name in `body` (a pool routes the training policy's step to a merged-weights engine)."""

    async def post(self, path: str, body: bytes, *, affinity: str | None = None,
                   replayable: bool = False, model: str | None = None) -> EngineAnswer: ...


class UpstreamResponse:
    """One engine answer: its status at once, the body read whole or chunk by chunk."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response

    @property
    def status(self) -> int:
        return self._response.status

    async def read(self) -> bytes:
        """The whole body; the connection goes back to the pool."""
        try:
            content = await self._response.read()
        except _CONNECTION_ERRORS as error:
            self.abort()
            raise EngineConnectionError(f"the engine's answer broke off ({error!r})") from error
        except BaseException:  # cancelled: whoever wanted the answer is gone
            self.abort()
            raise
        self._response.release()
        return content

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive (any split); the connection goes back to the pool at the end."""
        try:
            async for data in self._response.content.iter_any():
                yield data
        except _CONNECTION_ERRORS as error:
            self.abort()
            raise EngineConnectionError(f"the engine's answer broke off ({error!r})") from error
        self._response.release()

    def abort(self) -> None:
        """Close the connection without reading on: the engine sees its client go and stops generating."""
        self._response.close()


class Upstream:
    """POSTs JSON bodies to one engine at `base_url` over a keep-alive connection pool."""

    def __init__(self, base_url: str, *, max_connections: int = _MAX_CONNECTIONS,
                 connect_timeout_s: float = _CONNECT_TIMEOUT_S) -> None:
        self._base_url = yarl.URL(base_url.rstrip("/"))
        self._max_connections = max_connections
        self._timeout = aiohttp.ClientTimeout(total=None, connect=None, sock_connect=connect_timeout_s,
                                              sock_read=None)
        self._urls: dict[str, yarl.URL] = {}
        self._session: aiohttp.ClientSession | None = None  # created on first use, inside the event loop
        self._headers = {"Content-Type": "application/json"}  # built once, not per request

    def set_api_key(self, api_key: str) -> None:
        """Send the engine's key with every request from now on (a new dict: requests in flight keep theirs)."""
        self._headers = {"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"}

    def _session_or_new(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._max_connections, keepalive_timeout=_KEEPALIVE_S),
                timeout=self._timeout,
                cookie_jar=aiohttp.DummyCookieJar(),
                auto_decompress=False,
                skip_auto_headers=("User-Agent",),
            )
        return self._session

    async def post(self, path: str, body: bytes, *, affinity: str | None = None,
                   replayable: bool = False, model: str | None = None) -> UpstreamResponse:
        """Send `body` to `path`; returns once the status line and headers are in. (One engine: there is no
        other to choose by `affinity` or `model`, or to send a `replayable` request to again.)"""
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = self._base_url.join(yarl.URL(path))
        try:
            response = await self._session_or_new().post(url, data=body, headers=self._headers)
        except _CONNECTION_ERRORS as error:
            raise EngineConnectionError(f"the engine is unreachable ({error!r})") from error
        return UpstreamResponse(response)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
