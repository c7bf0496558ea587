"""Exports over HTTP: the step is checked here (torch-free), written by `python -m artlike_server.export` in a
child process (merged and GGUF weights need torch, which the server process never imports), then streamed
as an uncompressed tar whose files are those `artlike export` writes, under one top directory."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson

from ..errors import APIError, Conflict, InvalidRequest, NotFound
from .formats import ExportRequest, check_exportable, export_request
from .source import find_step

API_ERROR_EXIT = 3  # `__main__`'s exit status for an API error printed as JSON
_ERRORS: dict[int, type[APIError]] = {400: InvalidRequest, 404: NotFound, 409: Conflict}
_CHUNK = 1 << 20
_BLOCK = tarfile.BLOCKSIZE


class ExportFailed(RuntimeError):
    """The export process failed for a reason that is not the request's (the server's error, a 500)."""


@dataclass(frozen=True)
class ExportArchive:
    name: str  # the tar's file name and its top directory (without .tar)
    directory: Path  # the export, in a temporary directory that `chunks` removes when done

    def chunks(self) -> Iterator[bytes]:
        """The tar, a header and a file's bytes at a time (the export is never held in memory whole); the
        temporary directory is removed at the end, or when the client goes away."""
        try:
            for path in sorted(self.directory.rglob("*")):
                if not path.is_file():
                    continue
                info = tarfile.TarInfo(f"{self.name}/{path.relative_to(self.directory).as_posix()}")
                stat = path.stat()
                info.size, info.mtime, info.mode = stat.st_size, int(stat.st_mtime), 0o644
                yield info.tobuf(format=tarfile.PAX_FORMAT)
                with open(path, "rb") as handle:
                    while chunk := handle.read(_CHUNK):
                        yield chunk
                yield b"\0" * (-info.size % _BLOCK)
            yield b"\0" * (2 * _BLOCK)  # the end-of-archive marker
        finally:
            shutil.rmtree(self.directory.parent, ignore_errors=True)


class ExportService:
    def __init__(self, data_dir: Path, base_model_path: Path) -> None:
        self._data_dir = data_dir
        self._base_model_path = base_model_path
        self._work = data_dir / "exports"  # on the data dir's disk: an export can be as large as the model
        shutil.rmtree(self._work, ignore_errors=True)  # exports a stopped server left half-sent
        self._one_at_a_time = asyncio.Semaphore(1)  # a merge holds the whole model in memory
        # Called with (model, step, format, the tar's file name) once an export is written (the trackers).
        self.observers: list[Callable[[str, int, str, str], None]] = []

    async def export(self, name: str, step: int, format: str, dtype: str | None = None,
                     quant: str | None = None) -> ExportArchive:
        request = export_request(format, dtype, quant)
        source = await asyncio.to_thread(find_step, self._data_dir, f"{name}@{step}", base_path=self._base_path())
        check_exportable(request, source)
        self._work.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f"{name}-{step}-", dir=self._work))
        archive = ExportArchive(f"{name}-step{step}-{request.format}", work / "out")
        try:
            async with self._one_at_a_time:
                await self._run(source.reference, request, archive.directory)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        for observer in self.observers:
            observer(name, step, request.format, f"{archive.name}.tar")
        return archive

    def _base_path(self) -> Path | None:
        """The served base's directory (a hub id is left to the step's own record)."""
        return self._base_model_path if (self._base_model_path / "config.json").is_file() else None

    async def _run(self, reference: str, request: ExportRequest, out: Path) -> None:
        command = [sys.executable, "-m", "artlike_server.export", str(self._data_dir), reference, request.format,
                   str(out)]
        if request.format == "merged":
            command += ["--dtype", request.dtype]
        elif request.format == "gguf":
            command += ["--quant", request.quant]
        base = self._base_path()
        if base is not None:
            command += ["--base-model", str(base)]
        process = await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.PIPE,
                                                       stderr=asyncio.subprocess.PIPE, env=dict(os.environ))
        stdout, stderr = await process.communicate()
        if process.returncode == API_ERROR_EXIT:
            answer = orjson.loads(stdout.splitlines()[-1])
            error = answer["error"]
            raise _ERRORS.get(answer["status"], InvalidRequest)(error["message"], param=error.get("param"),
                                                                 code=error.get("code"))
        if process.returncode != 0:
            tail = stderr.decode(errors="replace").strip().splitlines()[-5:]
            raise ExportFailed(f"exporting {reference} as {request.format} failed: {' | '.join(tail)}")
