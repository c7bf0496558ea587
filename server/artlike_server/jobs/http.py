"""The jobs routers' JSON in and out: orjson both ways, a body that is not JSON is a 400."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response

from ..errors import InvalidRequest


def json_response(body: Any) -> Response:
    return Response(orjson.dumps(body), media_type="application/json")


async def json_body(request: Request) -> Any:
    try:
        return orjson.loads(await request.body())
    except orjson.JSONDecodeError as error:
        raise InvalidRequest(f"the body is not JSON: {error}", code="invalid_json") from error
