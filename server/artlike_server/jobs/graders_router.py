"""`POST /v1/fine_tuning/alpha/graders/run` and `/validate`, as in OpenAI's spec; a thin router."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..errors import InvalidRequest
from ..http_body import json_body
from ..state import get_state
from .http import json_response

router = APIRouter()


async def _body(request: Request) -> dict[str, Any]:
    body = await json_body(request)
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
    return json_response(result)


@router.post("/v1/fine_tuning/alpha/graders/validate")
async def validate_grader(request: Request) -> Response:
    body = await _body(request)
    get_state(request).graders.validate(body["grader"])
    return json_response({"grader": body["grader"]})
