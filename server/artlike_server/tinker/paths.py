"""Names of the Tinker API mapped to this server's: sessions, runs (trainable models), samplers, checkpoints.

    session id        tk<hex>                              made by `create_session`
    run (model) id    tk<hex>:train:<n>                    the SDK derives it too: f"{session_id}:train:{n}"
    model name        tk<hex>-train-<n>                    the run as a trainable model of this server
    sampler id        tk<hex>:sample:<n>
    checkpoint path   tinker://<run id>/<kind>/<name>      kind: weights (a training state) or sampler_weights
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from typing import Literal

from ..errors import InvalidRequest, NotFound

_RUN_ID = re.compile(r"^(tk[0-9a-f]{8,32}):train:(\d{1,6})$")
_MODEL_NAME = re.compile(r"^(tk[0-9a-f]{8,32})-train-(\d{1,6})$")
CheckpointKind = Literal["weights", "sampler_weights"]
CHECKPOINT_TYPES: dict[str, str] = {"weights": "training", "sampler_weights": "sampler"}


def new_session_id() -> str:
    return f"tk{secrets.token_hex(8)}"


def run_id(session_id: str, model_seq_id: int) -> str:
    return f"{session_id}:train:{model_seq_id}"


def session_of_run(run: str) -> str:
    return run.split(":", 1)[0]


def model_name(run: str) -> str:
    """The trainable model that holds run `run` (raises NotFound for an id this server never makes)."""
    match = _RUN_ID.match(run)
    if match is None:
        raise NotFound(f"no training run {run!r} on this server", param="model_id", code="run_not_found")
    return f"{match[1]}-train-{match[2]}"


def run_of_model(name: str) -> str | None:
    """The run id of a trainable model made through the Tinker API; None for other models."""
    match = _MODEL_NAME.match(name)
    return None if match is None else f"{match[1]}:train:{match[2]}"


@dataclass(frozen=True)
class CheckpointPath:
    run: str
    kind: CheckpointKind
    name: str

    @property
    def checkpoint_id(self) -> str:
        return f"{self.kind}/{self.name}"

    def __str__(self) -> str:
        return f"tinker://{self.run}/{self.checkpoint_id}"


def checkpoint_name(name: str, param: str = "path") -> str:
    """A checkpoint name as the SDK sends it (`save_state("000020")`): one path segment."""
    if not name or "/" in name or len(name) > 128 or name in {".", ".."}:
        raise InvalidRequest(f"checkpoint name {name!r} must be one non-empty path segment (no '/')", param=param,
                             code="invalid_checkpoint_name")
    return name


def parse_checkpoint_path(path: str, param: str = "path") -> CheckpointPath:
    """`tinker://<run>/<weights|sampler_weights>/<name>` of this server (400 otherwise)."""
    parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
    if len(parts) != 3 or parts[1] not in CHECKPOINT_TYPES:
        raise InvalidRequest(f"{path!r} is not a checkpoint path: expected tinker://<run id>/weights/<name> or "
                             "tinker://<run id>/sampler_weights/<name>", param=param, code="invalid_tinker_path")
    kind: CheckpointKind = "weights" if parts[1] == "weights" else "sampler_weights"
    return CheckpointPath(parts[0], kind, checkpoint_name(parts[2], param))
