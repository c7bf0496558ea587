"""The studio page: `/ui` (HTML), `/ui/static/{file}` (its script and styles), `/ui/session` (log in once).

Without an API key the page is served to loopback clients only (the same rule as the API, which refuses a
non-loopback host without a key). The HTML carries a Content-Security-Policy that allows only this
server's own scripts, so even a rendering mistake cannot run injected script.
"""

from __future__ import annotations

import hmac
import ipaddress
from pathlib import Path

from fastapi import APIRouter, Request, Response
from fastapi.responses import FileResponse
from pydantic import BaseModel

from ..errors import Forbidden, NotFound, Unauthorized
from ..http_body import parse_body
from ..middleware import is_authorized
from ..state import get_state
from .page_logins import COOKIE

STATIC_DIR = Path(__file__).with_name("static")
_MEDIA_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml",
                ".png": "image/png", ".ico": "image/x-icon"}
_PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                               "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; "
                               "base-uri 'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

router = APIRouter(include_in_schema=False)


class LoginRequest(BaseModel):
    api_key: str


class SessionInfo(BaseModel):
    auth_required: bool
    authenticated: bool
    csrf_token: str | None


def _check_reachable(request: Request) -> None:
    if get_state(request).page_logins.api_key:
        return
    host = request.client.host if request.client else ""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise Forbidden("the studio is served to this machine only when the server has no API key "
                        "(start it with --api-key to open it to others)", code="loopback_only")


@router.get("/ui")
async def page(request: Request) -> Response:
    _check_reachable(request)
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html", headers=_PAGE_HEADERS)


@router.get("/ui/static/{name}")
async def static_file(name: str, request: Request) -> Response:
    _check_reachable(request)
    path = STATIC_DIR / name
    if "/" in name or name.startswith(".") or not path.is_file():
        raise NotFound(f"no studio file {name!r}", code="not_found")
    return FileResponse(path, media_type=_MEDIA_TYPES.get(path.suffix, "application/octet-stream"),
                        headers=_PAGE_HEADERS)


@router.get("/ui/session", response_model=SessionInfo)
async def get_session(request: Request) -> SessionInfo:
    _check_reachable(request)
    state = get_state(request)
    if not state.page_logins.api_key:
        return SessionInfo(auth_required=False, authenticated=True, csrf_token=state.page_logins.keyless_csrf_token)
    csrf = state.page_logins.csrf_token(request.cookies.get(COOKIE))
    return SessionInfo(auth_required=True, authenticated=is_authorized(request.scope), csrf_token=csrf)


@router.post("/ui/session", response_model=SessionInfo)
async def log_in(request: Request, response: Response) -> SessionInfo:
    _check_reachable(request)
    body = await parse_body(request, LoginRequest)
    state = get_state(request)
    expected = state.page_logins.api_key
    if not expected:
        return SessionInfo(auth_required=False, authenticated=True, csrf_token=state.page_logins.keyless_csrf_token)
    if not hmac.compare_digest(body.api_key.encode(), expected.encode()):
        raise Unauthorized("invalid API key", param="api_key", code="invalid_api_key")
    token, csrf = state.page_logins.create()
    response.set_cookie(COOKIE, token, httponly=True, samesite="strict", path="/",
                        secure=request.url.scheme == "https", max_age=int(state.page_logins.ttl_s))
    return SessionInfo(auth_required=True, authenticated=True, csrf_token=csrf)


@router.delete("/ui/session", status_code=204)
async def log_out(request: Request) -> Response:
    get_state(request).page_logins.end(request.cookies.get(COOKIE))
    response = Response(status_code=204)
    response.delete_cookie(COOKIE, path="/", secure=request.url.scheme == "https", httponly=True, samesite="strict")
    return response
