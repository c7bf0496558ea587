"""Pure ASGI middleware (no BaseHTTPMiddleware: it buffers and adds a task per request on the hot path).

    ApiKeyMiddleware          `Authorization: Bearer <key>` or `x-api-key: <key>` (or `tml-<key>`, the Tinker SDK's form)
                              on every route but /health -> 401
                              (or the studio page's login cookie + X-CSRF-Token on writes -> 403 without);
                              a `Host` it does not know (hosts.py) -> 403 where no key stands in the way
    BodySizeLimitMiddleware   Content-Length over the limit -> 413 before reading; chunked bodies counted
    RequestMetricsMiddleware  count, latency and status per route template, in-flight gauge

Add them with `app.add_middleware(...)`; the last added runs outermost. Add BodySizeLimitMiddleware, then
ApiKeyMiddleware, then RequestMetricsMiddleware: every request is counted (401 and 413 included), and an
unauthenticated request is rejected before its body is looked at.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Collection
from typing import Protocol

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from artlike_server.errors import APIError, Forbidden, PayloadTooLarge, Unauthorized, error_response
from artlike_server.hosts import DEFAULT_HOSTS, HostPolicy, host_name
from artlike_server.metrics import Metrics

OPEN_PATHS = frozenset({"/health"})
"""Paths served without the API key: liveness probes (load balancers, `artlike serve` readiness) carry no
credentials, and /health reveals nothing but up/down to them (details need the key: `is_authorized`).
/metrics is protected: it names models."""
_AUTHORIZED = "artlike_authorized"  # key in the ASGI scope's "state" (Starlette's `request.state`)
CSRF_HEADER = "x-csrf-token"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


class PageLoginCheck(Protocol):
    """The studio page's logins as the key check sees them (the studio keeps them: `studio.page_logins`)."""

    def csrf_for_cookie(self, cookie_header: bytes) -> str | None:
        """The CSRF token of the live login a raw `Cookie:` header names, or None when it names none."""
        ...


def is_authorized(scope: Scope) -> bool:
    """Whether a request to an open path carried a valid key (True when the server has no key)."""
    return bool(scope.get("state", {}).get(_AUTHORIZED, False))


async def _reject(error: APIError, scope: Scope, receive: Receive, send: Send) -> None:
    await error_response(error)(scope, receive, send)


def _is_page(path: str) -> bool:
    """The studio page, its assets and its log-in routes (`/ui/session`): served without the key (the page asks for it)."""
    return path == "/ui" or path.startswith("/ui/")


def _same_origin(origin: bytes, host: bytes) -> bool:
    scheme, sep, rest = origin.partition(b"://")
    return bool(sep) and scheme in (b"http", b"https") and rest == host


def _host_not_allowed(hosts: list[bytes]) -> Forbidden:
    shown = ", ".join(repr(h.decode("latin-1")) for h in hosts)
    name = host_name(hosts[0]) if len(hosts) == 1 else None
    hint = f"--allowed-hosts {name}" if name else "--allowed-hosts NAME"
    return Forbidden(f"this server does not answer requests for host {shown}: open it as localhost, 127.0.0.1 or "
                     f"its IP address, or start it with {hint} to allow that name (a check against DNS "
                     "rebinding)", code="host_not_allowed")


class ApiKeyMiddleware:
    """The API key on every route but the open ones; the studio page's login cookie (with its CSRF token
    on writes) stands in for it. Browser writes from another origin are refused, key or not: a page on
    another site must not drive a loopback server that has no key.

    A `Host` that `hosts` does not allow is refused (403) on every route of a server without a key (its
    /health answers, with no details), and for the page and its cookie on a server with one: a valid key
    is the defence there, whatever name the request used."""

    def __init__(self, app: ASGIApp, api_key: str | None, open_paths: Collection[str] = OPEN_PATHS,
                 logins: PageLoginCheck | None = None, hosts: HostPolicy = DEFAULT_HOSTS) -> None:
        self.app = app
        self._hosts = hosts
        self._host_verdicts: dict[bytes, bool] = {}  # parsed once per name: clients use few
        self._expected = f"Bearer {api_key}".encode() if api_key else None
        self._expected_key = api_key.encode() if api_key else b""
        # The Tinker SDK refuses a key without its "tml-" prefix: `tml-<key>` is the same key to this server.
        self._expected_tinker_key = b"tml-" + self._expected_key if api_key else b""
        self._open_paths = frozenset(open_paths)
        self._logins = logins

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # `Authorization: Bearer <key>` (OpenAI's SDKs) or `x-api-key: <key>` (Anthropic's); the page's cookie.
        supplied = anthropic_key = cookie = csrf = origin = host = b""
        hosts: list[bytes] = []
        for name, value in scope["headers"]:
            if name == b"authorization":
                supplied = value
            elif name == b"x-api-key":
                anthropic_key = value
            elif name == b"cookie":
                cookie = value
            elif name == CSRF_HEADER.encode():
                csrf = value
            elif name == b"origin":
                origin = value
            elif name == b"host":
                host = value
                hosts.append(value)
        writes = scope["method"] not in SAFE_METHODS
        path = scope["path"]
        # Every request's Host is checked without a key, and the page's with one; elsewhere a keyed server
        # checks it only where the page's cookie may be what authenticates the request.
        guarded = self._expected is None or _is_page(path)
        known_host = self._known_host(hosts) if guarded or cookie else True
        if guarded and not known_host and path not in self._open_paths:
            await _reject(_host_not_allowed(hosts), scope, receive, send)
            return
        if writes and origin and not _same_origin(origin, host):
            await _reject(Forbidden("cross-origin request refused: this server takes browser writes only from "
                                    "its own pages", code="cross_origin"), scope, receive, send)
            return
        if self._expected is None:
            if path in self._open_paths:
                scope.setdefault("state", {})[_AUTHORIZED] = known_host
            await self.app(scope, receive, send)
            return
        authorized = hmac.compare_digest(supplied, self._expected) or (bool(anthropic_key) and (
            hmac.compare_digest(anthropic_key, self._expected_key)
            or hmac.compare_digest(anthropic_key, self._expected_tinker_key)))
        supplied = supplied or anthropic_key
        if not authorized and cookie and self._logins is not None:
            expected_csrf = self._logins.csrf_for_cookie(cookie)
            if expected_csrf is not None:
                if not known_host:
                    await _reject(_host_not_allowed(hosts), scope, receive, send)
                    return
                if writes and not hmac.compare_digest(expected_csrf.encode(), csrf):
                    await _reject(Forbidden(f"missing or wrong {CSRF_HEADER} header for this page login",
                                            code="csrf_failed"), scope, receive, send)
                    return
                authorized = True
        if _is_page(scope["path"]):
            scope.setdefault("state", {})[_AUTHORIZED] = authorized
            await self.app(scope, receive, send)
            return
        if scope["path"] in self._open_paths:
            scope.setdefault("state", {})[_AUTHORIZED] = authorized
            await self.app(scope, receive, send)
            return
        if authorized:
            await self.app(scope, receive, send)
            return
        error = Unauthorized(
            "missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')"
            if not supplied
            else "invalid API key",
            code="invalid_api_key",
        )
        error.headers["WWW-Authenticate"] = "Bearer"
        await _reject(error, scope, receive, send)

    def _known_host(self, hosts: list[bytes]) -> bool:
        if len(hosts) != 1:
            return self._hosts.allows(hosts)
        verdict = self._host_verdicts.get(hosts[0])
        if verdict is None:
            verdict = self._hosts.allows(hosts)
            if len(self._host_verdicts) < 1024:  # bounded: a client may send any number of names
                self._host_verdicts[hosts[0]] = verdict
        return verdict


class BodySizeLimitMiddleware:
    """Reject request bodies over `max_body_bytes` with 413, whether they declare a length or stream.

    A declared Content-Length over the limit is rejected before a byte is read. A chunked body is counted
    as it arrives; the receive wrapper raises `PayloadTooLarge` inside whatever reads the body, and this
    middleware answers the 413 itself, whatever the app made of that error (unless a response had
    already started, which no route does before reading its body).
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    def _too_large(self) -> PayloadTooLarge:
        return PayloadTooLarge(
            f"request body exceeds the server limit of {self.max_body_bytes} bytes", code="request_too_large"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = next((value for name, value in scope["headers"] if name == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await _reject(self._too_large(), scope, receive, send)
            return

        received = 0
        exceeded = response_started = False

        async def counting_receive() -> Message:
            nonlocal received, exceeded
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    exceeded = True
                    raise self._too_large()
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal response_started
            # Whatever the app answers once the body went over the limit (FastAPI turns any error while
            # reading a body into "400 error parsing the body") is replaced by the 413 below.
            if exceeded and not response_started:
                return
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except Exception:
            if not exceeded or response_started:
                raise
        if exceeded and not response_started:
            await _reject(self._too_large(), scope, receive, send)


class RequestMetricsMiddleware:
    """Counts every HTTP request by route template (the router writes the matched route into the scope).

    `metrics` may be omitted when the app builds its Metrics at startup (after middleware is added): it is
    then taken from `app.state.artlike.metrics` on each request.
    """

    def __init__(self, app: ASGIApp, metrics: Metrics | None = None) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        metrics: Metrics = self.metrics or scope["app"].state.artlike.metrics
        started = time.perf_counter()
        status = 500  # if the app raises before sending a response, the server answers 500

        async def status_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        metrics.in_flight.inc()
        try:
            await self.app(scope, receive, status_send)
        finally:
            metrics.in_flight.dec()
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            metrics.request_finished(template, scope["method"], status, time.perf_counter() - started)
