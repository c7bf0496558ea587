"""A safetensors file's tensor names, shapes and dtypes, read from its JSON header alone (no torch, no tensor
data)."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

_HEADER_LIMIT = 100 * 1024 * 1024  # a safetensors header is JSON; no real model's is anywhere near this


class SafetensorsHeaderError(ValueError):
    """The file is not a readable safetensors file: too short, a header that is not JSON, or offsets that
    point past the end of the file (a truncated download)."""


@dataclass(frozen=True)
class TensorEntry:
    dtype: str  # safetensors' names: "F32", "F16", "BF16", "I8", ...
    shape: list[int]


def safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor names and shapes from a safetensors file's JSON header (no tensor data is read)."""
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        if length > _HEADER_LIMIT:
            raise ValueError(f"{path}: safetensors header of {length} bytes")
        header = json.loads(handle.read(length))
    return {key: list(value.get("shape", [])) for key, value in header.items() if key != "__metadata__"}


def safetensors_tensors(path: Path) -> dict[str, TensorEntry]:
    """Tensor names, dtypes and shapes from the header, each entry checked and its data offsets checked
    against the file's size (`SafetensorsHeaderError` otherwise)."""
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) != 8:
            raise SafetensorsHeaderError(f"{path}: too short to be a safetensors file")
        (length,) = struct.unpack("<Q", prefix)
        if length > _HEADER_LIMIT:
            raise SafetensorsHeaderError(f"{path}: safetensors header of {length} bytes")
        raw = handle.read(length)
    if len(raw) != length:
        raise SafetensorsHeaderError(f"{path}: the safetensors header is cut short")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise SafetensorsHeaderError(f"{path}: the safetensors header is not JSON ({error})") from None
    if not isinstance(header, dict):
        raise SafetensorsHeaderError(f"{path}: the safetensors header is not a JSON object")
    data_size = path.stat().st_size - 8 - length
    tensors: dict[str, TensorEntry] = {}
    for key, value in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = value["dtype"], value["shape"], value["data_offsets"]
            valid = isinstance(dtype, str) and all(isinstance(n, int) and n >= 0 for n in (*shape, start, end))
        except (KeyError, TypeError, ValueError):
            valid = False
        if not valid:
            raise SafetensorsHeaderError(f"{path}: tensor {key!r} has a malformed header entry")
        if end > data_size or start > end:
            raise SafetensorsHeaderError(f"{path}: tensor {key!r} lies past the end of the file (truncated?)")
        tensors[key] = TensorEntry(dtype, list(shape))
    return tensors
