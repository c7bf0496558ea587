"""What a W&B offline run and an MLflow store hold, read with the trackers' own formats: W&B's offline run
file (`run-<id>.wandb`: LevelDB-log-framed `wandb_internal_pb2.Record` protos) and MLflow's `MlflowClient`."""

from __future__ import annotations

import json
import os
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

_BLOCK = 32 * 1024  # the LevelDB log format's block; a record's header: crc32c, length, type
_HEADER = struct.Struct("<IHB")
_FULL, _LAST = 1, 4


def wandb_run_records(path: Path) -> Iterator[Any]:
    """Every record of one offline run file, in order (a record still being written at its end is left out)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    position, pending = 7, b""  # after the file's header: ":W&B", a magic number and a version
    while position + _HEADER.size <= len(data):
        left = _BLOCK - position % _BLOCK
        if left < _HEADER.size:  # a block's tail too short for a header is padding
            position += left
            continue
        _, length, kind = _HEADER.unpack_from(data, position)
        if kind == 0 and length == 0:
            break
        chunk = data[position + _HEADER.size:position + _HEADER.size + length]
        if len(chunk) < length:
            break
        position += _HEADER.size + length
        pending += chunk
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_run(wandb_dir: Path, run_id: str) -> dict[str, Any]:
    """One run's history rows, config and summary across its offline run files (one per start of the run)."""
    run: dict[str, Any] = {"history": [], "config": {}, "summary": {}}
    for path in sorted(wandb_dir.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb")):
        for record in wandb_run_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                run["history"].append({_key(item): json.loads(item.value_json) for item in record.history.item})
            elif kind in ("run", "config"):
                updates = record.run.config.update if kind == "run" else record.config.update
                run["config"].update({_key(item): json.loads(item.value_json) for item in updates})
            elif kind == "summary":
                run["summary"].update({_key(item): json.loads(item.value_json) for item in record.summary.update})
    return run


def read_until(read: Callable[[], dict[str, Any]], holds: Callable[[dict[str, Any]], bool],
               timeout: float = 30.0) -> dict[str, Any]:
    """`read()` again until `holds` (W&B's service writes a run file on its own after `log` or even `finish`
    returns; the server's trackers write on their own thread); the last read when the time is up."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            found = read()
            if holds(found) or time.monotonic() > deadline:
                return found
        except (AssertionError, KeyError):
            if time.monotonic() > deadline:
                raise
        time.sleep(0.5)


def _key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


def mlflow_run(tracking_uri: str, model: str, experiment: str = "artlike") -> dict[str, Any]:
    """The MLflow run of one model (`artlike.model` tag): each metric's {step: value}, its params and tags."""
    from mlflow.tracking import MlflowClient

    if tracking_uri.startswith("file:"):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow's opt-in to reading its file store
    client = MlflowClient(tracking_uri=tracking_uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no MLflow experiment {experiment!r}"
    runs = client.search_runs([found.experiment_id], filter_string=f"tags.`artlike.model` = '{model}'")
    assert len(runs) == 1, runs
    run = runs[0]
    metrics = {key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
               for key in run.data.metrics}
    return {"metrics": metrics, "params": run.data.params, "tags": run.data.tags, "status": run.info.status}
