"""The on-disk store of trainable models: one directory per model under `<data_dir>/models/`.

    models/<name>/model.json          name, base model, LoRA config, creation time
    models/<name>/steps/<N>/          a PEFT adapter directory (vLLM and PEFT load it as is)
    models/<name>/history.jsonl       one JSON line per trained step
    models/<name>/.staging/           where new steps are written before they are renamed into place

Every write is atomic: files go through a temporary name + rename, a step directory is complete before
it is renamed to `steps/<N>`, so a crash leaves either the old state or the new one, never half a step.
Names are validated against `MODEL_NAME_PATTERN` before any path is built from them.

What counts as committed: a model exists once `model.json` does (written after step 0 is served); a
trained step N ≥ 1 once its history line does (written after step N is served). A step directory
without one is a job that died between the rename and the history line: `uncommitted_steps` lists
them, and start-up removes them, so a restart serves the last step that reported `done`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from artlike.types import LoraConfig, ModelKind, RewardHeadConfig, StepRetention, is_valid_model_name

from ..errors import InvalidRequest, NotFound
from ..fsync import fsync_directory
from ..jsonl_append import append_jsonl, read_jsonl

_ADAPTER_MARKER = "adapter_config.json"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoredModel:
    name: str
    base_model: str
    lora: LoraConfig
    created_at: float
    retention: StepRetention = field(default_factory=StepRetention)
    alias_step: int | None = None  # the step the alias is pinned to (a rollback or a held-back step); None: newest
    kind: ModelKind = "policy"  # "reward": a scorer, never loaded into the engine
    reward_head: RewardHeadConfig | None = None


def write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class ModelStore:
    def __init__(self, data_dir: Path) -> None:
        self.root = data_dir / "models"
        self.root.mkdir(parents=True, exist_ok=True)

    def model_dir(self, name: str) -> Path:
        if not is_valid_model_name(name):
            raise InvalidRequest(f"invalid model name {name!r}", param="model", code="invalid_model_name")
        return self.root / name

    def get(self, name: str) -> StoredModel | None:
        path = self.model_dir(name) / "model.json"
        if not path.is_file():
            return None
        raw = orjson.loads(path.read_bytes())
        head = raw.get("reward_head")
        return StoredModel(raw["name"], raw["base_model"], LoraConfig(**raw["lora"]), raw["created_at"],
                           StepRetention.model_validate(raw.get("retention") or {}), raw.get("alias_step"),
                           raw.get("kind", "policy"), None if head is None else RewardHeadConfig.model_validate(head))

    def require(self, name: str) -> StoredModel:
        model = self.get(name)
        if model is None:
            raise NotFound(f"model {name!r} is not registered", param="model", code="model_not_found")
        return model

    def all(self) -> list[StoredModel]:
        """Every readable model; one whose model.json cannot be read is logged and left out (never fatal)."""
        models = []
        for directory in sorted(self.root.iterdir()):
            if not is_valid_model_name(directory.name):
                continue
            try:
                model = self.get(directory.name)
            except (OSError, ValueError, KeyError, TypeError) as error:  # orjson and pydantic errors are ValueErrors
                log.error("model %r is not served: its model.json cannot be read (%s)", directory.name, error)
                continue
            if model is not None:
                models.append(model)
        return models

    def create(self, name: str, base_model: str, lora: LoraConfig, retention: StepRetention | None = None, *,
               kind: ModelKind = "policy", reward_head: RewardHeadConfig | None = None) -> StoredModel:
        """Write model.json. Registration calls this last, after step 0 is served: a model exists only
        once it is complete."""
        directory = self.model_dir(name)
        directory.mkdir(parents=True, exist_ok=True)
        model = StoredModel(name, base_model, lora, time.time(), retention or StepRetention(), kind=kind,
                            reward_head=reward_head)
        self._write_model_json(model)
        return model

    def set_retention(self, model: StoredModel, retention: StepRetention) -> StoredModel:
        updated = dataclasses.replace(model, retention=retention)
        self._write_model_json(updated)
        return updated

    def set_alias_step(self, name: str, step: int | None) -> None:
        """Pin the alias to `step` across restarts (None: the alias follows the newest committed step)."""
        model = self.require(name)
        if model.alias_step != step:
            self._write_model_json(dataclasses.replace(model, alias_step=step))

    def _write_model_json(self, model: StoredModel) -> None:
        record = {"name": model.name, "base_model": model.base_model, "lora": model.lora.model_dump(),
                  "created_at": model.created_at, "retention": model.retention.model_dump(),
                  "alias_step": model.alias_step, "kind": model.kind,
                  "reward_head": None if model.reward_head is None else model.reward_head.model_dump()}
        write_atomic(self.model_dir(model.name) / "model.json", orjson.dumps(record, option=orjson.OPT_INDENT_2))

    def delete_model(self, name: str) -> None:
        """Remove a model's directory (a registration that never completed); renamed away first, so a crash
        mid-delete never leaves a half model that looks complete."""
        directory = self.model_dir(name)
        if not directory.exists():
            return
        doomed = self.root / f".deleted-{name}-{time.monotonic_ns()}"
        os.rename(directory, doomed)
        shutil.rmtree(doomed, ignore_errors=True)

    # ------------------------------------------------------------------------------------ steps

    def steps(self, name: str) -> list[int]:
        steps_dir = self.model_dir(name) / "steps"
        if not steps_dir.is_dir():
            return []
        return sorted(
            int(d.name) for d in steps_dir.iterdir()
            if d.name.isascii() and d.name.isdigit() and (d / _ADAPTER_MARKER).is_file()
        )

    def latest_step(self, name: str) -> int | None:
        steps = self.steps(name)
        return steps[-1] if steps else None

    def committed_steps(self, name: str) -> list[int]:
        """Steps that are complete on disk and committed: step 0, and every step with a history line."""
        committed = {0} | {entry["step"] for entry in self.read_history(name) if isinstance(entry.get("step"), int)}
        return [step for step in self.steps(name) if step in committed]

    def uncommitted_steps(self, name: str) -> list[int]:
        """Step directories that never became committed (the job died before their history line)."""
        committed = set(self.committed_steps(name))
        return [step for step in self._step_numbers_on_disk(name) if step not in committed]

    def next_step_number(self, name: str) -> int:
        """The number a new step gets: above every step directory on disk, complete or not, so a leftover of
        a failed rollback or a step the engine refused never blocks the next commit."""
        return max(self._step_numbers_on_disk(name), default=-1) + 1

    def _step_numbers_on_disk(self, name: str) -> list[int]:
        steps_dir = self.model_dir(name) / "steps"
        if not steps_dir.is_dir():
            return []
        return sorted(int(d.name) for d in steps_dir.iterdir() if d.name.isascii() and d.name.isdigit())

    def step_dir(self, name: str, step: int) -> Path:
        return self.model_dir(name) / "steps" / str(step)

    def step_created_at(self, name: str, step: int) -> float:
        return (self.step_dir(name, step) / _ADAPTER_MARKER).stat().st_mtime

    def new_staging_dir(self, name: str) -> Path:
        staging = self.model_dir(name) / ".staging"
        staging.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix="step-", dir=staging))

    def commit_step(self, name: str, staging: Path, step: int) -> Path:
        """Move a complete adapter directory into place as `steps/<step>` (one atomic rename). Durable only
        when the caller has `fsync_tree(staging)` first (slow: ModelManager does it in a thread)."""
        if not (staging / _ADAPTER_MARKER).is_file():
            raise RuntimeError(f"{staging} holds no PEFT adapter ({_ADAPTER_MARKER} missing)")
        target = self.step_dir(name, step)
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():
            raise RuntimeError(f"step {step} of {name!r} already exists")
        os.rename(staging, target)
        fsync_directory(target.parent)  # the rename itself survives a power loss, before its history line
        return target

    def discard_staging(self, staging: Path) -> None:
        shutil.rmtree(staging, ignore_errors=True)

    def clear_staging(self, name: str) -> None:
        """Remove leftovers of jobs that died mid-write (called at start-up)."""
        shutil.rmtree(self.model_dir(name) / ".staging", ignore_errors=True)

    def delete_step(self, name: str, step: int) -> None:
        target = self.step_dir(name, step)
        if not target.exists():
            return
        # Rename first so a crash mid-delete never leaves a half step that looks complete.
        doomed = self.model_dir(name) / ".staging" / f"deleted-{step}-{time.monotonic_ns()}"
        doomed.parent.mkdir(parents=True, exist_ok=True)
        os.rename(target, doomed)
        shutil.rmtree(doomed, ignore_errors=True)

    # ---------------------------------------------------------------------------------- history

    def append_history(self, name: str, entry: dict[str, Any]) -> None:
        # A crash leaves at most a torn last line: the next append fences it off, so it never takes the
        # next step's line (and that step) with it, and read_history skips it.
        append_jsonl(self.model_dir(name) / "history.jsonl", entry)

    def read_history(self, name: str) -> list[dict[str, Any]]:
        return [entry for entry in read_jsonl(self.model_dir(name) / "history.jsonl") if isinstance(entry, dict)]


def fsync_tree(directory: Path) -> None:
    """fsync every file and directory under `directory`, itself included, so both the bytes and the names
    are on disk (slow: call it in a thread from async code)."""
    for path in directory.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
        elif path.is_dir():
            fsync_directory(path)
    fsync_directory(directory)
