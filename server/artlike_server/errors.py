"""Typed API errors, rendered in the OpenAI error shape: {"error": {"message", "type", "param", "code"}}.

    APIError                      any error the API returns on purpose (status + OpenAI error body)
    ├── InvalidRequest            400  bad JSON, schema violations, bad values (names the parameter)
    ├── Unauthorized              401  missing or wrong API key
    ├── Forbidden                 403  a page session without its CSRF token; /ui from afar without a key;
                                       a Host the server does not answer (DNS rebinding)
    ├── NotFound                  404  unknown model, step, trajectory or route
    ├── Conflict                  409  register with a different config; a second training job per model
    ├── PayloadTooLarge           413  request body over the configured limit
    └── ServiceUnavailable        503  engine down or restarting (carries Retry-After)

Routers raise these; one exception handler renders them. Anything else is a bug: it is logged with its
traceback and a request id, and the client gets a 500 in the same shape naming the exception type and that
request id (header `X-Request-Id` too) — never Starlette's plain-text "Internal Server Error".
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)


class APIError(Exception):
    status_code = 500
    error_type = "server_error"

    def __init__(
        self, message: str, *, param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


class InvalidRequest(APIError):
    status_code = 400
    error_type = "invalid_request_error"


class Unauthorized(APIError):
    status_code = 401
    error_type = "authentication_error"


class Forbidden(APIError):
    status_code = 403
    error_type = "permission_error"


class NotFound(APIError):
    status_code = 404
    error_type = "not_found_error"


class Conflict(APIError):
    status_code = 409
    error_type = "conflict_error"


class PayloadTooLarge(APIError):
    status_code = 413
    error_type = "invalid_request_error"


class ServiceUnavailable(APIError):
    status_code = 503
    error_type = "service_unavailable_error"

    def __init__(self, message: str, *, retry_after: float = 5.0, code: str | None = "engine_unavailable") -> None:
        super().__init__(message, code=code, headers={"Retry-After": str(max(1, round(retry_after)))})


def error_response(error: APIError, body: dict[str, Any] | None = None) -> Response:
    """`error` as an HTTP response: its OpenAI-shaped body, or `body` (another API's shape of the same error)."""
    return Response(
        orjson.dumps(error.body() if body is None else body),
        status_code=error.status_code,
        media_type="application/json",
        headers=error.headers,
    )


def internal_error_response(exc: BaseException, where: str) -> Response:
    """A 500 in the OpenAI error shape for a bug, logged with its traceback under a fresh request id."""
    request_id = f"req_{uuid.uuid4().hex[:20]}"
    log.error("unexpected error in %s (request id %s)", where, request_id, exc_info=exc)
    error = APIError(f"internal server error ({type(exc).__name__}); request id {request_id} in the server log",
                     code="internal_error", headers={"X-Request-Id": request_id})
    return error_response(error)


def validation_error(exc: RequestValidationError | ValidationError, *, prefix: str | None = None,
                     code: str = "invalid_value") -> InvalidRequest:
    """Turn pydantic's error list into one message that names the first offending parameter (under
    `prefix` when the model validated a part of the body, e.g. `grader`)."""
    errors = exc.errors()
    if not errors:
        return InvalidRequest("invalid request")
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part not in ("body", "query", "path")]
    msg = str(first.get("msg"))
    tag = _discriminator_field(first)
    if tag is not None:  # pydantic reports a missing or unknown union tag at the union, not at the tag
        loc.append(tag)
        msg = "Field required" if first.get("type") == "union_tag_not_found" else msg
    param = ".".join([prefix, *loc] if prefix else loc) or None
    if first.get("type") == "json_invalid":
        return InvalidRequest(f"request body is not valid JSON: {msg}", code="invalid_json")
    message = f"{param}: {msg}" if param else msg
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return InvalidRequest(message, param=param, code=code)


def _discriminator_field(error: Any) -> str | None:
    """The field a tagged union is told apart by (`kind` for a rating), when `error` is about that tag;
    None for other errors and for unions told apart by a function (no one field to name)."""
    if error.get("type") not in ("union_tag_not_found", "union_tag_invalid"):
        return None
    name = str((error.get("ctx") or {}).get("discriminator", ""))
    quoted = len(name) > 2 and name[0] == name[-1] == "'"
    return name[1:-1] if quoted else None


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return error_response(exc)

    async def on_validation_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return error_response(validation_error(exc))

    async def on_http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        kinds: dict[int, type[APIError]] = {404: NotFound, 401: Unauthorized, 403: Forbidden, 409: Conflict,
                                            413: PayloadTooLarge}
        kind = kinds.get(exc.status_code, InvalidRequest if exc.status_code < 500 else APIError)
        error = kind(str(exc.detail))
        error.status_code = exc.status_code
        return error_response(error)

    async def on_unexpected_error(request: Request, exc: Exception) -> Response:
        # Starlette's ServerErrorMiddleware calls this for anything no other handler took, then re-raises
        # it (uvicorn logs it once more); the id ties the client's answer to this log line.
        return internal_error_response(exc, f"{request.method} {request.url.path}")

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(Exception, on_unexpected_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
