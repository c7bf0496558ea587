"""The import into a data dir with no server running on it: the same files and history line a server writes,
under the data dir's lock (so no server starts in the middle). The next server start serves the step.

A new model's step 0 is the adapter; an existing model gets it as its next step (the alias moves to it unless
`promote` is false). Every write is staged and renamed: a failure leaves the data dir as it was."""

from __future__ import annotations

from pathlib import Path

import orjson

from ..data_dir_lock import DataDirLock
from ..default_model import DEFAULT_MODEL_ID, ensure_default_model
from ..models.store import ModelStore, StoredModel, fsync_tree
from .check import CONFIG_FILE, BaseModel, CheckedAdapter
from .steps import ImportedStep, check_fits_model, history_entry, write_step


def model_base(data_dir: Path, name: str) -> tuple[str, Path] | None:
    """An existing model's base: its id and where its weights are (where its newest step says the trainer
    read them, else the embedded model for its id, else the id as a path); None when the model is new."""
    store = ModelStore(data_dir)
    model = store.get(name)
    if model is None:
        return None
    for step in reversed(store.committed_steps(name)):
        try:
            written = orjson.loads((store.step_dir(name, step) / CONFIG_FILE).read_bytes()).get(
                "base_model_name_or_path")
        except (OSError, orjson.JSONDecodeError):
            continue
        if isinstance(written, str) and (Path(written) / "config.json").is_file():
            return model.base_model, Path(written)
    if model.base_model == DEFAULT_MODEL_ID:
        return model.base_model, ensure_default_model()
    return model.base_model, Path(model.base_model).expanduser()


def import_offline(data_dir: Path, name: str, checked: CheckedAdapter, base: BaseModel, *,
                   promote: bool = True) -> ImportedStep:
    """Write `checked` as a step of `name` in `data_dir`; `DataDirInUse` when a server holds the data dir."""
    with DataDirLock(data_dir):
        return write_import(data_dir, name, checked, base, promote=promote)


def write_import(data_dir: Path, name: str, checked: CheckedAdapter, base: BaseModel, *,
                 promote: bool = True) -> ImportedStep:
    """`import_offline` for a caller that holds the data dir's lock already."""
    store = ModelStore(data_dir)
    existing = store.get(name)
    if existing is None:
        return _create(store, name, checked, base)
    return _add(store, existing, checked, str(base.path), promote=promote)


def _create(store: ModelStore, name: str, checked: CheckedAdapter, base: BaseModel) -> ImportedStep:
    if store.model_dir(name).exists():  # a registration that died before model.json
        store.delete_model(name)
    try:
        staging = store.new_staging_dir(name)
        write_step(checked, staging, str(base.path))
        fsync_tree(staging)
        store.commit_step(name, staging, 0)
        store.create(name, base.name, checked.lora)
        store.append_history(name, history_entry(0, checked, promoted=True))
    except BaseException:
        store.delete_model(name)
        raise
    return ImportedStep(name, 0, created=True, promoted=True)


def _add(store: ModelStore, model: StoredModel, checked: CheckedAdapter, base_path: str, *,
         promote: bool) -> ImportedStep:
    check_fits_model(model, checked)
    name = model.name
    committed = store.committed_steps(name)
    serving = model.alias_step if model.alias_step in committed else (committed[-1] if committed else None)
    staging = store.new_staging_dir(name)
    try:
        write_step(checked, staging, base_path)
        fsync_tree(staging)
    except BaseException:
        store.discard_staging(staging)
        raise
    step = store.next_step_number(name)
    store.commit_step(name, staging, step)
    try:
        store.set_alias_step(name, None if promote else serving)
        store.append_history(name, history_entry(step, checked, promoted=promote))  # the commit point
    except BaseException:
        store.set_alias_step(name, model.alias_step)
        store.delete_step(name, step)
        raise
    return ImportedStep(name, step, created=False, promoted=promote)
