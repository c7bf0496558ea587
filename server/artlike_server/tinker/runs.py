"""What the Tinker API remembers of each training run across restarts: its base, LoRA rank, the caller's
metadata and its named checkpoints, each the step of the run's trainable model it was saved as.

One JSON file per run under `<data_dir>/tinker/runs/`, rewritten atomically on every change: a crash leaves
the previous version, never half a file. The weights themselves are the model's steps (`models/<name>/`),
kept by the model store like any other step.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import orjson

from ..models.store import write_atomic
from .paths import CheckpointKind, CheckpointPath, model_name


@dataclass
class Checkpoint:
    kind: CheckpointKind
    name: str
    step: int
    time: float
    user_metadata: dict[str, str] = field(default_factory=dict)


@dataclass
class Run:
    run_id: str
    base_model: str
    lora_rank: int
    created_at: float
    last_request_time: float
    user_metadata: dict[str, str] = field(default_factory=dict)
    checkpoints: list[Checkpoint] = field(default_factory=list)

    @property
    def model(self) -> str:
        return model_name(self.run_id)

    def checkpoint(self, kind: CheckpointKind, name: str) -> Checkpoint | None:
        return next((c for c in self.checkpoints if c.kind == kind and c.name == name), None)

    def path_of(self, checkpoint: Checkpoint) -> CheckpointPath:
        return CheckpointPath(self.run_id, checkpoint.kind, checkpoint.name)


class RunStore:
    def __init__(self, data_dir: Path) -> None:
        self._dir = data_dir / "tinker" / "runs"
        self._runs: dict[str, Run] = {}
        self._lock = threading.Lock()  # writes come from worker threads
        self._loaded = False

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        if not self._dir.is_dir():
            return
        for path in sorted(self._dir.glob("*.json")):
            raw = orjson.loads(path.read_bytes())
            raw["checkpoints"] = [Checkpoint(**c) for c in raw.get("checkpoints", [])]
            run = Run(**raw)
            self._runs[run.run_id] = run

    def get(self, run_id: str) -> Run | None:
        self._load()
        return self._runs.get(run_id)

    def all(self) -> list[Run]:
        self._load()
        return sorted(self._runs.values(), key=lambda run: run.created_at, reverse=True)

    def add(self, run: Run) -> None:
        self._load()
        self._runs[run.run_id] = run
        self.save(run)

    def save(self, run: Run) -> None:
        with self._lock:
            self._dir.mkdir(parents=True, exist_ok=True)
            write_atomic(self._dir / f"{run.model}.json", orjson.dumps(asdict(run)))

    def touch(self, run: Run) -> None:
        run.last_request_time = time.time()  # in memory: written with the run's next change

    def record_checkpoint(self, run: Run, checkpoint: Checkpoint) -> None:
        """Add (or, under the same kind and name, replace) a checkpoint, persisted before it is answered."""
        run.checkpoints = [c for c in run.checkpoints if (c.kind, c.name) != (checkpoint.kind, checkpoint.name)]
        run.checkpoints.append(checkpoint)
        self.save(run)

    def remove_checkpoint(self, run: Run, checkpoint: Checkpoint) -> None:
        run.checkpoints = [c for c in run.checkpoints if c is not checkpoint]
        self.save(run)
