"""Logins of the studio page: the API key is asked for once, then a cookie stands in for it.

`POST /ui/session {"api_key"}` creates a login: a random token in an HttpOnly, SameSite=Strict cookie
(scripts cannot read it, other sites cannot send it) and a CSRF token the page keeps in memory and sends
as `X-CSRF-Token` on every POST/PUT/PATCH/DELETE (checked by `ApiKeyMiddleware`). Logins live in this
process's memory: a restart asks for the key again. They expire after `ttl_s` without use.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass

COOKIE = "artlike_session"
DEFAULT_TTL_S = 12 * 3600.0


@dataclass
class _Login:
    csrf_token: str
    expires_at: float


class PageLogins:
    """The page's live logins, by cookie token; `ApiKeyMiddleware` asks `csrf_for_cookie` on each request."""

    def __init__(self, ttl_s: float = DEFAULT_TTL_S, *, api_key: str | None = None) -> None:
        self.ttl_s = ttl_s
        self.api_key = api_key  # what a log-in must give (None: the server has no key, the page needs none)
        self._logins: dict[str, _Login] = {}
        # Without an API key there is no cookie: one CSRF token for the (loopback-only) page.
        self.keyless_csrf_token = secrets.token_urlsafe(24)

    def create(self) -> tuple[str, str]:
        """A new login: (cookie token, CSRF token)."""
        self._expire()
        token, csrf = secrets.token_urlsafe(32), secrets.token_urlsafe(24)
        self._logins[token] = _Login(csrf, time.monotonic() + self.ttl_s)
        return token, csrf

    def csrf_token(self, token: str | None) -> str | None:
        """The CSRF token of a live login (its expiry moves on), or None."""
        login = self._logins.get(token) if token else None
        if login is None or login.expires_at < time.monotonic():
            return None
        login.expires_at = time.monotonic() + self.ttl_s
        return login.csrf_token

    def csrf_for_cookie(self, cookie_header: bytes) -> str | None:
        """The CSRF token of the live login a raw `Cookie:` header names, or None."""
        return self.csrf_token(cookie_value(cookie_header))

    def end(self, token: str | None) -> None:
        if token:
            self._logins.pop(token, None)

    def _expire(self) -> None:
        now = time.monotonic()
        for token in [t for t, login in self._logins.items() if login.expires_at < now]:
            del self._logins[token]


def cookie_value(header: bytes, name: str = COOKIE) -> str | None:
    """The value of cookie `name` in a raw `Cookie:` header."""
    for part in header.decode("latin-1").split(";"):
        key, sep, value = part.strip().partition("=")
        if sep and key == name:
            return value
    return None
