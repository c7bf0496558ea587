"""Managed jobs from Python: upload a dataset, hand over a reward, let the server train.

    jobs = art.Jobs("http://127.0.0.1:8000", api_key=KEY)
    job = await jobs.start(data="rows.jsonl", reward="reward.py", iterations=20)   # or grader={...}
    async for event in jobs.follow(job.id):          # the job's events, live, until it ends
        print(event.message)
    job = await jobs.get(job.id)                     # job.fine_tuned_model: a model name to chat with

The wire format is OpenAI's fine-tuning jobs API (`/v1/files`, `/v1/fine_tuning/jobs`), so anything
started here is visible to the `openai` SDK and to MotteRL's routes too. Every method has a `_sync` variant,
generated from it (`_syncify`).
"""

from __future__ import annotations

import builtins
import os
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import httpx
import orjson
from pydantic import BaseModel

from ._backend import Backend
from ._errors import APIConnectionError
from ._http import DEFAULT_TIMEOUT, Connection, Multipart, RetryPolicy
from ._syncify import iterate_sync, syncify
from .job_types import Checkpoint, Job, JobEvent

Method = Literal["reinforcement", "supervised", "dpo"]
FOLLOW_IDLE_TIMEOUT_S = 120.0  # the server re-reads the job at least every 15 s; longer silence is a dead link


_END = object()


def _followed(line: str) -> JobEvent | object | None:
    """One line of a followed log: an event, `_END` (the final job object), or None (a blank line)."""
    if not line:
        return None
    item = orjson.loads(line)
    return JobEvent.model_validate(item) if item.get("object") == "fine_tuning.job.event" else _END


def _is_file_id(data: object) -> bool:
    return isinstance(data, str) and data.startswith("file-")


def _jsonl(rows: Iterable[Mapping[str, Any]]) -> bytes:
    return b"".join(orjson.dumps(dict(row)) + b"\n" for row in rows)


def _text_or_file(value: str | Path, suffix: str) -> str:
    """Source text, or the content of a file path (a str counts as a path when it ends with `suffix` and exists)."""
    if isinstance(value, Path) or (value.endswith(suffix) and "\n" not in value and os.path.exists(value)):
        return Path(value).read_text()
    return value


def reinforcement_body(*, model: str, training_file: str, validation_file: str | None, reward: str | Path | None,
                       grader: Mapping[str, Any] | str | Path | None, method: Method, suffix: str | None,
                       seed: int | None, metadata: Mapping[str, str] | None,
                       hyperparameters: Mapping[str, Any]) -> dict[str, Any]:
    """The `POST /v1/fine_tuning/jobs` body: OpenAI's, with artlike's hyperparameters in the same dict."""
    chosen = {k: v.model_dump() if isinstance(v, BaseModel) else v  # art.Schedule, art.DynamicSampling
              for k, v in hyperparameters.items() if v is not None}
    body: dict[str, Any] = {"model": model, "training_file": training_file}
    body |= {k: v for k, v in {"validation_file": validation_file, "suffix": suffix, "seed": seed,
                               "metadata": dict(metadata) if metadata else None}.items() if v is not None}
    if method == "reinforcement":
        if (reward is None) == (grader is None):
            raise ValueError("a reinforcement job needs exactly one of reward= (Python source or a .py path) "
                             "or grader= (a grader dict or a .json path)")
        if reward is not None:
            chosen_grader: Any = {"type": "python", "name": "reward", "source": _text_or_file(reward, ".py")}
        elif isinstance(grader, Mapping):
            chosen_grader = dict(grader)
        else:
            assert grader is not None
            chosen_grader = orjson.loads(_text_or_file(grader, ".json"))
        body["method"] = {"type": "reinforcement",
                          "reinforcement": {"grader": chosen_grader, "hyperparameters": chosen}}
    else:
        if reward is not None or grader is not None:
            raise ValueError(f"a {method} job learns from its rows: it takes no reward or grader")
        body["method"] = {"type": method, method: {"hyperparameters": chosen}}
    return body


class Jobs:
    """The server's managed jobs. `base_url` is the server (not `/v1`); `api_key` defaults to ARTLIKE_API_KEY."""

    def __init__(self, base_url: str, api_key: str | None = None, *, model: str | None = None,
                 timeout: float | httpx.Timeout = DEFAULT_TIMEOUT, retry: RetryPolicy | None = None,
                 transport: httpx.AsyncBaseTransport | None = None,
                 sync_transport: httpx.BaseTransport | None = None) -> None:
        self.model = model  # the default `model=` of start(): a base model or a trainable model's name
        self._backend = Backend(Connection(
            base_url, api_key=api_key if api_key is not None else os.environ.get("ARTLIKE_API_KEY"),
            timeout=timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout), retry=retry,
            transport=transport, sync_transport=sync_transport))

    # ------------------------------------------------------------------------------------ requests

    def _upload_body(self, data: str | Path | Iterable[Mapping[str, Any]], purpose: str) -> Multipart:
        if isinstance(data, str | Path):
            path = Path(data)
            return Multipart({"purpose": purpose}, {"file": (path.name, path.read_bytes())})
        return Multipart({"purpose": purpose}, {"file": ("rows.jsonl", _jsonl(data))})

    def _start_body(self, training_file: str, validation_file: str | None, options: dict[str, Any]) -> dict[str, Any]:
        model = options.pop("model") or self.model
        if model is None:
            raise ValueError("start() needs model= (the server's base model, or a trainable model's name; "
                             "base_model() names it)")
        return reinforcement_body(model=model, training_file=training_file, validation_file=validation_file,
                                  **options)

    # ---------------------------------------------------------------------------------------- async

    async def upload(self, data: str | Path | Iterable[Mapping[str, Any]], *, purpose: str = "fine-tune") -> str:
        """A JSONL file (path) or rows (dicts) uploaded as a file; returns its id."""
        return await self._backend.upload_file(self._upload_body(data, purpose))

    async def start(self, *, data: str | Path | Iterable[Mapping[str, Any]], reward: str | Path | None = None,
                    grader: Mapping[str, Any] | str | Path | None = None, model: str | None = None,
                    validation_data: str | Path | Iterable[Mapping[str, Any]] | None = None,
                    method: Method = "reinforcement", suffix: str | None = None, seed: int | None = None,
                    metadata: Mapping[str, str] | None = None, **hyperparameters: Any) -> Job:
        """Start a job. `data`/`validation_data`: a file id ("file-..."), a JSONL path, or rows. Hyperparameters:
        OpenAI's (`n_epochs`, `batch_size`, `learning_rate_multiplier`, `eval_interval`) and artlike's
        (`iterations`, `group_size`, `learning_rate`, `max_tokens`, `temperature`, `max_turns`, `multi_step`),
        and against a flattening curve `dynamic_sampling` (True or an `art.DynamicSampling`), `entropy_coef`,
        `entropy_control` (an `art.EntropyControl`), `epsilon_high`, `clip_cov_fraction`,
        `positive_advantage_weight`, `temperature_schedule`, `group_size_schedule`, `learning_rate_schedule`
        (`art.Schedule`s over iterations) and `guide_field` (a row field with a reference answer for rows no
        rollout passes)."""
        options: dict[str, Any] = {"reward": reward, "grader": grader, "model": model, "method": method, "suffix": suffix,
                   "seed": seed, "metadata": metadata, "hyperparameters": hyperparameters}
        reinforcement_body(model="check", training_file="check", validation_file=None,  # fail before uploading
                           **{k: v for k, v in options.items() if k != "model"})
        training_file = await self._file_id(data)
        validation_file = await self._file_id(validation_data) if validation_data is not None else None
        return await self._backend.create_job(self._start_body(training_file, validation_file, options))

    async def _file_id(self, data: str | Path | Iterable[Mapping[str, Any]]) -> str:
        return str(data) if _is_file_id(data) else await self.upload(data)

    async def get(self, job_id: str) -> Job:
        return await self._backend.get_job(job_id)

    async def list(self, *, limit: int = 20, after: str | None = None) -> builtins.list[Job]:
        return await self._backend.list_jobs(limit, after)

    async def cancel(self, job_id: str) -> Job:
        return await self._backend.control_job(job_id, "cancel")

    async def pause(self, job_id: str) -> Job:
        return await self._backend.control_job(job_id, "pause")

    async def resume(self, job_id: str) -> Job:
        return await self._backend.control_job(job_id, "resume")

    async def events(self, job_id: str, *, after: str | None = None, limit: int = 100) -> builtins.list[JobEvent]:
        """A page of events, newest first (OpenAI's order)."""
        return await self._backend.job_events(job_id, limit, after)

    async def checkpoints(self, job_id: str) -> builtins.list[Checkpoint]:
        return await self._backend.job_checkpoints(job_id)

    async def follow(self, job_id: str) -> AsyncIterator[JobEvent]:
        """Every event of the job, oldest first, as it happens, until the job ends (or pauses). A dropped
        connection is resumed after the last event seen."""
        last: str | None = None
        while True:
            try:
                async for line in self._backend.job_log_lines(job_id, last, FOLLOW_IDLE_TIMEOUT_S):
                    event = _followed(line)
                    if event is _END:
                        return
                    if isinstance(event, JobEvent):
                        last = event.id
                        yield event
                return
            except APIConnectionError:
                continue

    async def wait(self, job_id: str, *, on_event: Callable[[JobEvent], None] | None = None) -> Job:
        """Follow the job until it ends; the final job (check `job.status`)."""
        async for event in self.follow(job_id):
            if on_event is not None:
                on_event(event)
        return await self.get(job_id)

    async def base_model(self) -> str:
        """The server's base model (the first model `/v1/models` lists)."""
        return (await self._backend.served_models())[0]

    # ----------------------------------------------------------------------------------------- sync

    upload_sync = syncify(upload)
    start_sync = syncify(start)
    get_sync = syncify(get)
    list_sync = syncify(list)
    cancel_sync = syncify(cancel)
    pause_sync = syncify(pause)
    resume_sync = syncify(resume)
    events_sync = syncify(events)
    checkpoints_sync = syncify(checkpoints)
    wait_sync = syncify(wait)
    base_model_sync = syncify(base_model)

    def follow_sync(self, job_id: str) -> Iterator[JobEvent]:
        """`follow` for sync code."""
        return iterate_sync(self.follow(job_id))

    def close(self) -> None:
        """Close an injected sync-only transport (`sync_transport=`); no call keeps a connection open."""
        self._backend.connection.close()
