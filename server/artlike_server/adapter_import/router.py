"""`POST /v1/trainable_models/{name}/steps/import` (thin: the work is `ImportService`'s)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Request, Response

from ..state import get_state

router = APIRouter()


@router.post("/v1/trainable_models/{name}/steps/import")
async def import_step(
    name: str, request: Request, response: Response,
    promote: bool = Query(True, description="serve the step under the alias `name` (an existing model)"),
    any_base_name: bool = Query(False, description="accept an adapter that names another base (shapes are "
                                                   "still checked)"),
) -> dict[str, Any]:
    """A PEFT LoRA adapter directory, sent as an uncompressed tar, as a new step of `name` (created when it
    does not exist), served at once as `name@N`. 201 with the step."""
    answer = await get_state(request).imports.import_archive(name, request.stream(), promote=promote,
                                                             any_base_name=any_base_name)
    response.status_code = 201
    return answer
