"""Browser sessions of the studio page: the API key is asked for once, then a cookie stands in for it.

`POST /ui/session {"api_key"}` creates a session: a random token in an HttpOnly, SameSite=Strict cookie
(scripts cannot read it, other sites cannot send it) and a CSRF token the page keeps in memory and sends
as `X-CSRF-Token` on every POST/PUT/PATCH/DELETE (checked by `ApiKeyMiddleware`). Sessions live in this
process's memory: a restart asks for the key again. They expire after `ttl_s` without use.
"""

from __future__ import annotations

import hmac
import secrets
import time
from dataclasses import dataclass

COOKIE = "artlike_session"
CSRF_HEADER = "x-csrf-token"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
DEFAULT_TTL_S = 12 * 3600.0


@dataclass
class _Session:
    csrf_token: str
    expires_at: float


class UiSessions:
    def __init__(self, ttl_s: float = DEFAULT_TTL_S, *, api_key: str | None = None) -> None:
        self.ttl_s = ttl_s
        self.api_key = api_key  # what a log-in must give (None: the server has no key, the page needs none)
        self._sessions: dict[str, _Session] = {}
        # Without an API key there is no cookie: one CSRF token for the (loopback-only) page.
        self.keyless_csrf_token = secrets.token_urlsafe(24)

    def create(self) -> tuple[str, str]:
        """A new session: (cookie token, CSRF token)."""
        self._expire()
        token, csrf = secrets.token_urlsafe(32), secrets.token_urlsafe(24)
        self._sessions[token] = _Session(csrf, time.monotonic() + self.ttl_s)
        return token, csrf

    def csrf_token(self, token: str | None) -> str | None:
        """The CSRF token of a live session (its expiry moves on), or None."""
        session = self._sessions.get(token) if token else None
        if session is None or session.expires_at < time.monotonic():
            return None
        session.expires_at = time.monotonic() + self.ttl_s
        return session.csrf_token

    def end(self, token: str | None) -> None:
        if token:
            self._sessions.pop(token, None)

    def _expire(self) -> None:
        now = time.monotonic()
        for token in [t for t, s in self._sessions.items() if s.expires_at < now]:
            del self._sessions[token]


def csrf_matches(expected: str, supplied: bytes) -> bool:
    return hmac.compare_digest(expected.encode(), supplied)


def cookie_value(header: bytes, name: str = COOKIE) -> str | None:
    """The value of cookie `name` in a raw `Cookie:` header."""
    for part in header.decode("latin-1").split(";"):
        key, sep, value = part.strip().partition("=")
        if sep and key == name:
            return value
    return None
