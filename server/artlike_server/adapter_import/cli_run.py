"""What `artlike import` does: the import through a running server's route (the adapter sent as a tar), or,
with no server on the data dir, into the data dir directly. Either way the answer is the route's body."""

from __future__ import annotations

import urllib.parse
from pathlib import Path
from typing import Any

import httpx

from ..data_dir_lock import DataDirLock
from ..default_model import DEFAULT_MODEL_ID, ensure_default_model
from ..errors import APIError
from .archive import pack_adapter
from .check import BaseModel, check_adapter
from .offline import model_base, write_import

UPLOAD_TIMEOUT_S = 600.0  # the server loads and verifies the adapter in the engine before it answers


class ImportFailed(RuntimeError):
    """The import was refused or could not run; the message says why."""


def import_through_data_dir(adapter: Path, model: str, data_dir: Path, *, base_model: str | None,
                            max_lora_rank: int, promote: bool, any_base_name: bool) -> dict[str, Any]:
    """Check and write the adapter into `data_dir`; `DataDirInUse` when a server holds it (before any check:
    the server's base and rank limit are the ones that count then)."""
    try:
        with DataDirLock(data_dir):
            name, path = model_base(data_dir, model) or _base(base_model)
            base = BaseModel(name, path, max_lora_rank)
            checked = check_adapter(adapter.expanduser().resolve(), base, any_base_name=any_base_name)
            return write_import(data_dir, model, checked, base, promote=promote).body(checked)
    except APIError as error:
        raise ImportFailed(_described(error)) from None


def import_through_server(adapter: Path, model: str, server: str, *, api_key: str | None, promote: bool,
                          any_base_name: bool) -> dict[str, Any]:
    try:
        archive = pack_adapter(adapter.expanduser().resolve())
    except APIError as error:
        raise ImportFailed(_described(error)) from None
    url = f"{server.rstrip('/').removesuffix('/v1')}/v1/trainable_models/{urllib.parse.quote(model, safe='')}" \
          "/steps/import"
    headers = {"Content-Type": "application/x-tar", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    params = {"promote": str(promote).lower(), "any_base_name": str(any_base_name).lower()}
    try:
        response = httpx.post(url, content=archive, headers=headers, params=params, timeout=UPLOAD_TIMEOUT_S)
    except httpx.HTTPError as error:
        raise ImportFailed(f"cannot reach the server at {server} ({error})") from None
    try:
        body: Any = response.json()
    except ValueError:
        body = None
    if response.status_code >= 400 or not isinstance(body, dict):
        problem = body.get("error") if isinstance(body, dict) else None
        if isinstance(problem, dict):
            param = f" [{problem['param']}]" if problem.get("param") else ""
            raise ImportFailed(f"{problem.get('message')}{param} (HTTP {response.status_code})")
        raise ImportFailed(f"the server answered HTTP {response.status_code}: {response.text[:300]}")
    return body


def _base(base_model: str | None) -> tuple[str, Path]:
    """A new model's base as `artlike serve --model` names it: the embedded model, a directory, or a hub id."""
    if base_model is None:
        return DEFAULT_MODEL_ID, ensure_default_model()
    local = Path(base_model).expanduser()
    if local.is_dir():
        return local.name, local.resolve()
    return base_model, Path(base_model)


def _described(error: APIError) -> str:
    return f"{error.message} [{error.param}]" if error.param else error.message
