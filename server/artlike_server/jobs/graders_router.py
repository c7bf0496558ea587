"""`POST /v1/fine_tuning/alpha/graders/run` and `/validate`, as in OpenAI's spec; a thin router."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..errors import InvalidRequest
from ..state import get_state

router = APIRouter()


async def _body(request: Request) -> dict[str, Any]:
    try:
        body = orjson.loads(await request.body())
    except orjson.JSONDecodeError as error:
        raise InvalidRequest(f"the body is not JSON: {error}", code="invalid_json") from error
    if not isinstance(body, dict) or "grader" not in body:
        raise InvalidRequest("the body must be an object with a 'grader'", param="grader", code="invalid_value")
    return body


@router.post("/v1/fine_tuning/alpha/graders/run")
async def run_grader(request: Request) -> Response:
    body = await _body(request)
    if "model_sample" not in body:
        raise InvalidRequest("model_sample (the model's output to grade) is required", param="model_sample",
                             code="invalid_value")
    result = await get_state(request).graders.run(body["grader"], body["model_sample"], body.get("item"))
    return Response(orjson.dumps(result), media_type="application/json")


@router.post("/v1/fine_tuning/alpha/graders/validate")
async def validate_grader(request: Request) -> Response:
    body = await _body(request)
    get_state(request).graders.validate(body["grader"])
    return Response(orjson.dumps({"grader": body["grader"]}), media_type="application/json")
