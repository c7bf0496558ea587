"""The adapter directory as an uncompressed tar: what `artlike import` sends and the route reads. Only the
adapter's own files travel; the route reads them at the top of the tar or under one top directory (as the
export route writes them), and never writes a path the archive names."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path, PurePosixPath

from ..errors import InvalidRequest
from .check import ADAPTER_FILES, PICKLED_WEIGHTS_FILE, check_files

_CHUNK = 1 << 20


def pack_adapter(directory: Path) -> bytes:
    """The adapter's files (checked to be there first) as an uncompressed tar."""
    check_files(directory)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for name in ADAPTER_FILES:
            archive.add(directory / name, arcname=name, recursive=False)
    return buffer.getvalue()


def unpack_adapter(archive_path: Path, into: Path) -> Path:
    """The adapter's files from the tar at `archive_path`, written into `into` under their own names (other
    members are skipped); `InvalidRequest` (param `adapter`) when it is no tar or holds a file twice."""
    into.mkdir(parents=True, exist_ok=True)
    seen: set[str] = set()
    try:
        with tarfile.open(archive_path, mode="r:") as archive:
            for member in archive:
                path = PurePosixPath(member.name)
                if not member.isfile() or len(path.parts) > 2:
                    continue
                if path.name == PICKLED_WEIGHTS_FILE:
                    seen.add(path.name)
                if path.name not in ADAPTER_FILES:
                    continue
                if path.name in seen:
                    raise InvalidRequest(f"the archive holds {path.name} twice", param="adapter",
                                         code="invalid_adapter")
                seen.add(path.name)
                source = archive.extractfile(member)
                if source is None:
                    continue
                with source, open(into / path.name, "wb") as target:
                    while chunk := source.read(_CHUNK):
                        target.write(chunk)
    except tarfile.TarError as error:
        raise InvalidRequest(f"the body is not an uncompressed tar of the adapter directory ({error})",
                             param="adapter", code="invalid_adapter") from None
    if PICKLED_WEIGHTS_FILE in seen:
        (into / PICKLED_WEIGHTS_FILE).touch()  # never read: it is there so the check names it
    return into
