"""Imports on a running server: the uploaded tar unpacked into a temporary directory under the data dir,
checked (torch-free), then made a step by the model manager's own transactions, so the engine loads and
lists it before it counts: a new model is registered with the adapter as its step 0, an existing one gets
it as its next step. A refusal leaves no trace; the temporary directory is removed either way."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

from ..engine.client import EngineRequestError
from ..errors import Conflict, InvalidRequest
from ..models.manager import AdapterRefused, engine_unavailable
from ..models.registry import ModelRegistry
from .archive import unpack_adapter
from .check import BaseModel, CheckedAdapter, check_adapter
from .steps import ImportedStep, check_fits_model, history_entry, write_step


class ImportService:
    def __init__(self, data_dir: Path, registry: ModelRegistry) -> None:
        self._registry = registry
        self._work = data_dir / "imports"
        shutil.rmtree(self._work, ignore_errors=True)  # uploads a stopped server left behind

    async def import_archive(self, name: str, body: AsyncIterator[bytes], *, promote: bool = True,
                             any_base_name: bool = False) -> dict[str, Any]:
        """The tar in `body` as a step of `name`; the route's answer."""
        self._registry.store.model_dir(name)  # an invalid name is a 400 before the upload is read
        self._work.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self._work))
        try:
            upload = work / "adapter.tar"
            handle = await asyncio.to_thread(upload.open, "wb")
            try:
                async for chunk in body:
                    await asyncio.to_thread(handle.write, chunk)
            finally:
                await asyncio.to_thread(handle.close)
            base = self._registry.base
            checked = await asyncio.to_thread(self._check, upload, work / "adapter",
                                              BaseModel(base.name, base.path, base.max_lora_rank), any_base_name)
            imported = await self._import(name, checked, promote=promote)
            return imported.body(checked)
        finally:
            await asyncio.to_thread(shutil.rmtree, work, True)

    @staticmethod
    def _check(upload: Path, directory: Path, base: BaseModel, any_base_name: bool) -> CheckedAdapter:
        return check_adapter(unpack_adapter(upload, directory), base, any_base_name=any_base_name)

    async def _import(self, name: str, checked: CheckedAdapter, *, promote: bool) -> ImportedStep:
        registry, manager = self._registry, self._registry.manager
        base_path = str(registry.base.path)
        try:
            if registry.store.get(name) is None:

                async def write_step0(staging: Path) -> None:
                    await asyncio.to_thread(write_step, checked, staging, base_path)

                model, created = await manager.register(name, registry.base.name, checked.lora, None, write_step0)
                if created:
                    await manager.record_event(name, history_entry(0, checked, promoted=True))
                    return ImportedStep(name, 0, created=True, promoted=True)
            model = registry.store.require(name)
            check_fits_model(model, checked)
            if registry.is_training(name):
                raise Conflict(f"model {name!r} is training; import after the job finishes",
                               code="training_in_progress")
            staging = registry.store.new_staging_dir(name)
            try:
                await asyncio.to_thread(write_step, checked, staging, base_path)
            except BaseException:
                registry.store.discard_staging(staging)
                raise
            committed = await manager.commit_step(
                name, staging, lambda step, seconds: history_entry(step, checked, promoted=promote,
                                                                   swap_seconds=seconds), promote=promote)
            return ImportedStep(name, committed.step, created=False, promoted=promote)
        except AdapterRefused as error:
            raise InvalidRequest(f"the engine does not serve the adapter: {error}", param="adapter",
                                 code="adapter_refused") from error
        except EngineRequestError as error:
            if 400 <= error.status < 500:
                raise InvalidRequest(f"the engine refused the adapter: {error.body[:500]}", param="adapter",
                                     code="adapter_refused") from error
            raise engine_unavailable(error, f"load the adapter imported as {name!r}") from error
        except httpx.TransportError as error:
            raise engine_unavailable(error, f"load the adapter imported as {name!r}") from error
