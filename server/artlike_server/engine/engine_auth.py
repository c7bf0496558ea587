"""ASGI middleware that vLLM loads (`--middleware`, see launch.py): every engine route but /health needs the key.

vLLM's own `--api-key`/VLLM_API_KEY guard covers only paths under /v1, /v2, /inference and /cohere, so
/invocations (SageMaker: any chat or completion), /tokenize, /scale_elastic_ep and the like would stay
open to any local user. This guard reads the same VLLM_API_KEY (set per engine start by the supervisor)
and leaves only /health open, which the supervisor polls without credentials. It runs inside the vLLM
process: keep it free of artlike imports.
"""

from __future__ import annotations

import hmac
import os

from starlette.types import ASGIApp, Receive, Scope, Send

OPEN_PATHS = frozenset({"/health"})
_UNAUTHORIZED = b'{"error":"Unauthorized"}'


class EngineKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str | None = None) -> None:
        key = api_key or os.environ.get("VLLM_API_KEY")  # vLLM passes no arguments: the environment's
        if not key:  # refusing to start beats an engine that is silently open
            raise RuntimeError("EngineKeyMiddleware needs VLLM_API_KEY in the engine's environment")
        self.app = app
        self._expected = f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        supplied = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        if hmac.compare_digest(supplied, self._expected):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(_UNAUTHORIZED)).encode())]})
        await send({"type": "http.response.body", "body": _UNAUTHORIZED})
