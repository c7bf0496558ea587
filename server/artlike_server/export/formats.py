"""What an export may ask for, checked before any work starts: the format, the dtype of merged weights and
the GGUF file's tensor type (llama.cpp's `convert_hf_to_gguf.py --outtype` names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from ..errors import InvalidRequest
from .source import StepSource

ExportFormat = Literal["peft", "merged", "gguf"]
MergedDtype = Literal["bfloat16", "float16", "float32"]
GgufType = Literal["f32", "f16", "bf16", "q8_0"]

FORMATS: tuple[str, ...] = get_args(ExportFormat)
DTYPES: tuple[str, ...] = get_args(MergedDtype)
GGUF_TYPES: tuple[str, ...] = get_args(GgufType)
DEFAULT_DTYPE: MergedDtype = "bfloat16"
DEFAULT_GGUF_TYPE: GgufType = "f16"  # llama.cpp's converter writes f16 unless told otherwise


@dataclass(frozen=True)
class ExportRequest:
    format: ExportFormat
    dtype: MergedDtype = DEFAULT_DTYPE  # merged weights only
    quant: GgufType = DEFAULT_GGUF_TYPE  # gguf only


def export_request(format: str, dtype: str | None = None, quant: str | None = None) -> ExportRequest:
    """The request, or InvalidRequest naming the parameter that is wrong (a dtype for GGUF, a quantisation
    for merged weights, anything outside the lists)."""
    if format not in FORMATS:
        raise InvalidRequest(f"format must be one of {', '.join(FORMATS)}, not {format!r}", param="format",
                             code="invalid_export_format")
    if dtype is not None:
        if format != "merged":
            raise InvalidRequest(f"dtype applies to the merged format only (gguf takes quant: {', '.join(GGUF_TYPES)})",
                                 param="dtype", code="invalid_value")
        if dtype not in DTYPES:
            raise InvalidRequest(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}", param="dtype",
                                 code="invalid_value")
    if quant is not None:
        if format != "gguf":
            raise InvalidRequest("quant applies to the gguf format only", param="quant", code="invalid_value")
        if quant not in GGUF_TYPES:
            raise InvalidRequest(f"GGUF quantisation {quant!r} is not supported; choose one of "
                                 f"{', '.join(GGUF_TYPES)}", param="quant", code="unsupported_quantization")
    return ExportRequest(format, dtype or DEFAULT_DTYPE, quant or DEFAULT_GGUF_TYPE)  # type: ignore[arg-type]


def check_exportable(request: ExportRequest, source: StepSource) -> None:
    """InvalidRequest when `source` cannot be written as asked (a reward model as GGUF)."""
    if request.format == "gguf" and source.kind == "reward":
        raise InvalidRequest(f"{source.reference} is a reward model: GGUF holds generative models only; export "
                             "it as peft or merged", param="format", code="unsupported_export")
