"""Exceptions raised by the artlike client.

    ArtlikeError                      base of everything below
    ├── APIError                      the server answered with an error status (status_code, type, code,
    │   │                             param, message: the server's OpenAI-shape error body)
    │   ├── BadRequestError           400  invalid value, base model mismatch, bad request body
    │   ├── AuthenticationError       401  missing or wrong API key
    │   ├── NotFoundError             404  unknown model, step, trajectory or route
    │   ├── ConflictError             409  register with a different config; a second training job
    │   ├── PayloadTooLargeError      413  request body over the server's limit
    │   ├── ServiceUnavailableError   503  engine starting or restarting (retry_after, seconds)
    │   └── InternalServerError       other 5xx: a server bug, named in the message
    ├── APIConnectionError            no usable answer: connection refused or dropped
    │   └── APITimeoutError           no answer (or no stream line) within the timeout
    ├── TrainingError                 the train stream failed: an `error` line (code, message,
    │                                 served_step), or a stream that broke the protocol
    └── JudgeError                    judging a group failed (code, raw): the judge's request failed,
                                      its answer was not the scores asked for, or a trajectory was unreadable

Statuses map to classes by status code only (never by message text). Transient statuses (502, 503, 504)
and connection failures are retried with backoff before any of these is raised (see `RetryPolicy`).
"""

from __future__ import annotations

from typing import Any

import httpx
import orjson

from .types import ErrorEvent

__all__ = [
    "APIConnectionError",
    "APIError",
    "APITimeoutError",
    "ArtlikeError",
    "AuthenticationError",
    "BadRequestError",
    "ConflictError",
    "InternalServerError",
    "JudgeError",
    "NotFoundError",
    "PayloadTooLargeError",
    "ServiceUnavailableError",
    "TrainingError",
]


class ArtlikeError(Exception):
    """Base class of every error the artlike client raises on purpose."""


class APIError(ArtlikeError):
    """The server answered with an error status; the fields come from its OpenAI-shape error body."""

    def __init__(
        self,
        message: str,
        *,
        status_code: int,
        type: str | None = None,  # the OpenAI error body's field name
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type
        self.code = code
        self.param = param

    def __str__(self) -> str:
        details = ", ".join(f"{key}={value!r}" for key, value in (("code", self.code), ("param", self.param)) if value)
        return f"{self.status_code}: {self.message}" + (f" ({details})" if details else "")


class BadRequestError(APIError):
    pass


class AuthenticationError(APIError):
    pass


class NotFoundError(APIError):
    pass


class ConflictError(APIError):
    pass


class PayloadTooLargeError(APIError):
    pass


class ServiceUnavailableError(APIError):
    def __init__(self, message: str, *, retry_after: float | None = None, **fields: Any) -> None:
        super().__init__(message, **fields)
        self.retry_after = retry_after  # seconds the server asked us to wait, when it said


class InternalServerError(APIError):
    pass


class APIConnectionError(ArtlikeError):
    """The request got no usable answer (refused, reset, DNS failure, ...), after retries."""


class APITimeoutError(APIConnectionError):
    pass


class TrainingError(ArtlikeError):
    """The training job failed: the server's `error` line, or a stream that ended or broke unexpectedly.

    `served_step` is the step still served when the server said so (the previous one: a failed job never
    changes what is served). Client-side codes: "stream_incomplete" (the stream ended without a `done`
    line; the server may still finish the step, check `model.get_step()`), "invalid_stream" (a line that
    is not a valid event).
    """

    def __init__(self, message: str, *, code: str, served_step: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.served_step = served_step

    @classmethod
    def from_event(cls, event: ErrorEvent) -> TrainingError:
        return cls(event.message, code=event.code, served_step=event.served_step)

    def __str__(self) -> str:
        served = f"; step {self.served_step} is still served" if self.served_step is not None else ""
        return f"{self.message} (code={self.code!r}{served})"


class JudgeError(ArtlikeError):
    """An LLM judge could not score a group (`art.judge_group`); never turned into a reward of 0.

    `code`: "api_error" (the judge's request failed after the openai client's retries), "invalid_output"
    (not the JSON asked for: unparseable, cut off, a score missing or outside [0, 1]; `raw` holds the
    answer), "trajectory_unavailable" (the server could not show a recorded trajectory), "judge_unavailable"
    (401/403/404: a wrong key or an unknown model, which would fail every group, so it is always raised).
    `retryable`: whether asking again may help; `attempts`: how many times it was asked.
    """

    def __init__(self, message: str, *, code: str, raw: str | None = None, retryable: bool = True) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.raw = raw
        self.retryable = retryable and code in ("api_error", "invalid_output")
        self.attempts = 1

    def __str__(self) -> str:
        attempts = f", {self.attempts} attempts" if self.attempts > 1 else ""
        return f"{self.message} (code={self.code!r}{attempts})"


_ERRORS_BY_STATUS: dict[int, type[APIError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    404: NotFoundError,
    409: ConflictError,
    413: PayloadTooLargeError,
    503: ServiceUnavailableError,
}


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header given in seconds ("5", "1.5"); None when absent or a date.

    The server sends seconds; an HTTP-date (allowed by RFC 9110) falls back to our own backoff.
    """
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if seconds >= 0 else None


def error_from_response(response: httpx.Response) -> APIError:
    """The typed error for an error response (its body must have been read)."""
    message, fields = _error_fields(response)
    status = response.status_code
    if status == 503:
        return ServiceUnavailableError(
            message, retry_after=parse_retry_after(response.headers.get("retry-after")), status_code=status, **fields
        )
    kind = _ERRORS_BY_STATUS.get(status, InternalServerError if status >= 500 else APIError)
    return kind(message, status_code=status, **fields)


def _error_fields(response: httpx.Response) -> tuple[str, dict[str, Any]]:
    """Message and type/code/param from `{"error": {...}}`; a body of another shape becomes the message."""
    try:
        body = orjson.loads(response.content)
    except orjson.JSONDecodeError:
        body = None
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        fields = {key: error[key] if isinstance(error.get(key), str) else None for key in ("type", "code", "param")}
        return error["message"], fields
    text = response.text.strip()[:500] or response.reason_phrase or "no error message"
    return text, {"type": None, "code": None, "param": None}
