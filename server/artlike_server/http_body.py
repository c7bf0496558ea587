"""Request bodies in, one way for every router: parse → validate → one error path.

The raw bytes are parsed as JSON whatever the Content-Type says (`curl -d '{...}'` sends
`application/x-www-form-urlencoded`, and a JSON body is what every one of these routes takes), validated
by a pydantic model or `TypeAdapter`, and any failure is raised as an `InvalidRequest` (400, OpenAI error
shape) naming the failing parameter. FastAPI body models are not used: they accept JSON only under a JSON
Content-Type and validate on the event loop, where a large body would stall every stream in flight.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar, overload

import orjson
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic_core import ErrorDetails
from starlette.requests import Request

from .errors import InvalidRequest, validation_error

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

Locate = Callable[[ErrorDetails], ErrorDetails]
"""Rewrites one pydantic error before it is reported (e.g. drops a union tag from its location)."""


def read_json(raw: bytes) -> Any:
    """Any JSON value; a body that is not JSON is a 400 with code `invalid_json`."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as error:
        raise InvalidRequest(f"request body is not valid JSON: {error}", code="invalid_json") from None


@overload
def parse_json(raw: bytes, schema: type[M], *, locate: Locate | None = None, prefix: str | None = None) -> M: ...
@overload
def parse_json(raw: bytes, schema: TypeAdapter[T], *, locate: Locate | None = None,
               prefix: str | None = None) -> T: ...
def parse_json(raw: bytes, schema: type[BaseModel] | TypeAdapter[Any], *, locate: Locate | None = None,
               prefix: str | None = None) -> Any:
    """`raw` validated by `schema`; a validation error is a 400 naming its parameter (under `prefix`)."""
    try:
        if isinstance(schema, TypeAdapter):
            return schema.validate_json(raw)
        return schema.model_validate_json(raw)
    except ValidationError as error:
        raise validation_error(_located(error, locate), prefix=prefix) from None


def validate(value: Any, schema: type[M], *, prefix: str | None = None) -> M:
    """An already-parsed JSON value validated by `schema`, with the same 400 as `parse_json`."""
    try:
        return schema.model_validate(value)
    except ValidationError as error:
        raise validation_error(error, prefix=prefix) from None


async def json_body(request: Request) -> Any:
    """The request's body as any JSON value (for routes that look into it before choosing a model)."""
    return read_json(await request.body())


@overload
async def parse_body(request: Request, schema: type[M], *, default: M | None = None, in_thread: bool = False,
                     locate: Locate | None = None) -> M: ...
@overload
async def parse_body(request: Request, schema: TypeAdapter[T], *, default: T | None = None,
                     in_thread: bool = False, locate: Locate | None = None) -> T: ...
async def parse_body(request: Request, schema: type[BaseModel] | TypeAdapter[Any], *, default: Any = None,
                     in_thread: bool = False, locate: Locate | None = None) -> Any:
    """The request's body validated by `schema`. An empty body is `default` when one is given, else a 400.

    `in_thread` parses in a worker thread: for bodies that may be tens of MB (offline trajectories)."""
    raw = await request.body()
    if not raw.strip():
        if default is not None:
            return default
        raise InvalidRequest("the request body is empty; a JSON body is required", code="invalid_json")
    if in_thread:
        return await asyncio.to_thread(parse_json, raw, schema, locate=locate)
    return parse_json(raw, schema, locate=locate)


def _located(error: ValidationError, locate: Locate | None) -> ValidationError | RequestValidationError:
    return error if locate is None else RequestValidationError([locate(e) for e in error.errors()])
