"""Checks of a translated request's fields, shared by the dialects: each failure is a 400 naming the field in
the caller's own API (`input[2].call_id`, `messages.0.content.1.type`), and the SSE event writer."""

from __future__ import annotations

from typing import Any

import orjson

from artlike_server.errors import InvalidRequest


def bad(param: str, message: str, code: str = "invalid_value") -> InvalidRequest:
    return InvalidRequest(f"{param}: {message}", param=param, code=code)


def expect(value: Any, kind: type | tuple[type, ...], param: str, what: str) -> Any:
    """`value` when it is a `kind`, else a 400 saying `param` must be `what` (a JSON boolean is no number)."""
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise bad(param, f"must be {what}")
    return value


def sse_event(kind: str, payload: dict[str, Any]) -> bytes:
    """A named server-sent event, as both the Responses and the Messages APIs stream them."""
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"
