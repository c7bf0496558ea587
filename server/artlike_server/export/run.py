"""One export: checked, written into a temporary directory beside `out`, renamed into place at the end, so a
failed export leaves nothing at `out` (and never touches a directory that was already there)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from ..errors import Conflict
from .adapter import write_adapter
from .card import write_model_card
from .formats import ExportRequest, check_exportable
from .source import StepSource


def check_target(out: Path) -> None:
    """`out` must not exist, or be an empty directory."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise Conflict(f"{out} already exists and is not an empty directory; choose another --out",
                       param="out", code="export_target_exists")


def export_step(source: StepSource, request: ExportRequest, out: Path) -> Path:
    out = out.expanduser().resolve()
    check_target(out)
    check_exportable(request, source)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    try:
        _write(source, request, staging)
        write_model_card(staging, source, request)
        for path in staging.rglob("*"):  # steps are written private; an export is for sharing
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
        os.chmod(staging, 0o755)
        if out.is_dir():
            out.rmdir()  # empty (checked above); rmdir refuses anything else
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _write(source: StepSource, request: ExportRequest, staging: Path) -> None:
    # The weight writers import torch: only when asked for, so `peft` needs neither torch nor a GPU.
    if request.format == "peft":
        write_adapter(source, staging)
    elif request.format == "merged":
        import torch

        from .merged import write_merged

        write_merged(source, staging, getattr(torch, request.dtype))
    else:
        from .gguf_file import write_gguf

        write_gguf(source, staging, request.quant)
