"""A safetensors file's tensor names and shapes, read from its JSON header alone (no torch, no tensor data)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

_HEADER_LIMIT = 100 * 1024 * 1024  # a safetensors header is JSON; no real model's is anywhere near this


def safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor names and shapes from a safetensors file's JSON header (no tensor data is read)."""
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        if length > _HEADER_LIMIT:
            raise ValueError(f"{path}: safetensors header of {length} bytes")
        header = json.loads(handle.read(length))
    return {key: list(value.get("shape", [])) for key, value in header.items() if key != "__metadata__"}
