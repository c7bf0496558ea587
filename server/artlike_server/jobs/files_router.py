"""`/v1/files` as OpenAI shapes it (the official SDK's `client.files.*` work); a thin router over FileStore."""

from __future__ import annotations

import asyncio
from typing import Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from starlette.datastructures import UploadFile

from ..errors import InvalidRequest
from ..state import get_state
from .http import json_response

router = APIRouter()


@router.post("/v1/files")
async def upload(request: Request) -> Response:
    form = await request.form()
    upload = form.get("file")
    purpose = form.get("purpose")
    if not isinstance(upload, UploadFile):
        raise InvalidRequest("a multipart field 'file' with the file's content is required", param="file",
                             code="missing_file")
    if not isinstance(purpose, str) or not purpose:
        raise InvalidRequest("a multipart field 'purpose' is required (e.g. fine-tune)", param="purpose",
                             code="missing_purpose")
    content = await upload.read()
    files = get_state(request).files
    stored = await asyncio.to_thread(files.create, content, upload.filename or "upload.jsonl", purpose)
    return json_response(stored.to_openai())


@router.get("/v1/files")
async def list_files(request: Request, purpose: str | None = None, limit: int = Query(10_000, ge=1, le=10_000),
                     after: str | None = None, order: Literal["asc", "desc"] = "desc") -> Response:
    files, has_more = get_state(request).files.page(purpose=purpose, limit=limit, after=after, order=order)
    return json_response({"object": "list", "data": [f.to_openai() for f in files],
                  "first_id": files[0].id if files else None, "last_id": files[-1].id if files else None,
                  "has_more": has_more})


@router.get("/v1/files/{file_id}")
async def retrieve(request: Request, file_id: str) -> Response:
    return json_response(get_state(request).files.get(file_id).to_openai())


@router.get("/v1/files/{file_id}/content")
async def content(request: Request, file_id: str) -> Response:
    data = await asyncio.to_thread(get_state(request).files.read, file_id)
    return Response(data, media_type="application/octet-stream")


@router.delete("/v1/files/{file_id}")
async def delete(request: Request, file_id: str) -> Response:
    await asyncio.to_thread(get_state(request).files.delete, file_id)
    return json_response({"id": file_id, "object": "file", "deleted": True})
