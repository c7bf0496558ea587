"""`GET /v1/trainable_models/{name}/steps/{step}/export` (thin: the work is `ExportService`'s)."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from ..state import get_state

router = APIRouter()


@router.get("/v1/trainable_models/{name}/steps/{step}/export")
async def export_step(
    name: str, step: int, request: Request,
    export_format: str = Query("merged", alias="format", description="peft, merged or gguf"),
    dtype: str | None = Query(None, description="merged: bfloat16 (default), float16 or float32"),
    quant: str | None = Query(None, description="gguf: f16 (default), bf16, f32 or q8_0"),
) -> StreamingResponse:
    """The step exported as `artlike export` writes it, streamed as an uncompressed tar."""
    archive = await get_state(request).exports.export(name, step, export_format, dtype, quant)
    return StreamingResponse(archive.chunks(), media_type="application/x-tar",
                             headers={"Content-Disposition": f'attachment; filename="{archive.name}.tar"'})
