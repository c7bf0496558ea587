"""The job engine: creates jobs, queues them per target model, runs them, and resumes them after a restart.

One job runs per target model at a time (the others queue, oldest first); jobs on different models run
side by side and share the trainer like any other clients. State lives in `JobStore`; this service only
holds what a running process needs (the runner tasks and their stop flags). On start it requeues every
job a previous process left unfinished: a running job continues from its last committed iteration.
On shutdown runner tasks are cancelled without touching their status, so the next start resumes them,
unless a cancel or pause was requested (stored with the job): the next start applies it instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from artlike.graders import Compute

from ..errors import Conflict, InvalidRequest, NotFound
from .intake import runs_user_code
from .rewards import JobReward, Judge, Scorer
from .runner import JobFailed, JobRunner, ServerAccess, StopFlag
from .sandbox import Sandbox, SandboxUnavailable
from .spec import FINISHED, JobSpec
from .store import CheckpointRecord, EventRecord, JobRecord, JobStore, event_seq

log = logging.getLogger(__name__)

FOLLOW_POLL_S = 15.0  # a follower re-reads the store at least this often, even without a notification
STOP_WAIT_S = 2.0  # a cancel or pause of a running job waits this long for its step to end before answering


@dataclass(frozen=True)
class NewJob:
    """A validated request, ready to be stored: the spec plus the rows it trains and validates on."""

    spec: JobSpec
    train_rows: list[Any]
    validation_rows: list[Any]
    training_file: str | None = None
    validation_file: str | None = None
    suffix: str | None = None
    metadata: dict[str, str] | None = None
    warnings: tuple[str, ...] = ()


def train_config(spec: JobSpec) -> dict[str, Any]:
    """A job's train config as the trackers record it: its spec without the reward's code."""
    return spec.model_dump(mode="json", exclude={"reward": {"source"}})


def new_job_id() -> str:
    return f"ftjob-{secrets.token_hex(12)}"


class JobService:
    def __init__(self, store: JobStore, sandbox: Sandbox, server: ServerAccess, judge: Judge | None,
                 scorer: Scorer | None = None, compute: Compute | None = None) -> None:
        self.store = store
        self.sandbox = sandbox
        self.server = server
        self.judge = judge
        self.scorer = scorer  # reward_model graders
        self.compute = compute  # the text graders' work: the grader pool (None: inline)
        self._running: dict[str, tuple[str, asyncio.Task[None], StopFlag]] = {}  # target model -> job
        self._changed: dict[str, asyncio.Event] = {}
        self._closed = False
        store.on_event = self.notify
        # Called with (target model, job id, train config) as a job starts or resumes (the trackers); must not raise.
        self.config_observers: list[Callable[[str, str, dict[str, Any]], None]] = []

    # --------------------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Requeue what a previous process left unfinished, then start the queues. A cancel or pause that was
        requested before the stop (it waits for the end of a step) is applied first: that job does not run."""
        unfinished = self.store.unfinished()
        for job in unfinished:
            if job.stop_request is not None:
                self._apply_stored_stop(job)
            elif job.status == "running":
                self._event(job.id, f"the server restarted; the job resumes from iteration {job.iteration}",
                            level="warn")
                self.store.update(job.id, status="queued")
            elif job.status == "validating_files":
                self.store.update(job.id, status="queued")
        for model in {j.spec.target_model for j in unfinished}:
            self._schedule(model)

    def _apply_stored_stop(self, job: JobRecord) -> None:
        if job.stop_request == "cancel":
            self._finish(job.id, "cancelled", "cancelled at restart: the cancel requested before the server "
                                              f"stopped was applied (after iteration {job.iteration})")
        else:
            self.store.update(job.id, status="paused", stop_request=None)
            self._event(job.id, "paused at restart: the pause requested before the server stopped was applied; "
                                f"resume the job to continue from iteration {job.iteration}")

    async def shutdown(self) -> None:
        self._closed = True
        tasks = [task for _, task, _ in self._running.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._running.clear()

    def running_jobs(self) -> list[str]:
        return [job_id for job_id, _, _ in self._running.values()]

    # ------------------------------------------------------------------------------------- create

    def create(self, new: NewJob) -> JobRecord:
        if runs_user_code(new.spec.reward):  # refused now (503), rather than failing once it runs
            self.sandbox.require()
        job_id = new_job_id()
        job = self.store.create(job_id, new.spec, training_file=new.training_file,
                                validation_file=new.validation_file, suffix=new.suffix, metadata=new.metadata,
                                train_rows=new.train_rows, validation_rows=new.validation_rows)
        spec = new.spec
        self._event(job_id, f"created: {spec.method} on {spec.base_model} -> {spec.target_model}, "
                            f"{spec.train_rows} training rows, {spec.iterations} iteration(s)")
        for warning in (*new.warnings, *filter(None, [spec.learning_rate_warning()])):
            self._event(job_id, warning, level="warn")
        self._schedule(spec.target_model)
        return self.store.get(job.id)

    # ---------------------------------------------------------------------------------- queries

    def get(self, job_id: str) -> JobRecord:
        job = self.store.find(job_id)
        if job is None:
            raise NotFound(f"no fine-tuning job {job_id!r}", param="fine_tuning_job_id", code="job_not_found")
        return job

    def page(self, *, limit: int, after: str | None, metadata: dict[str, str] | None = None
             ) -> tuple[list[JobRecord], bool]:
        if after is not None:
            self.get(after)
        return self.store.page(limit=limit, after=after, metadata=metadata)

    # ---------------------------------------------------------------------------------- control

    async def cancel(self, job_id: str) -> JobRecord:
        """A queued or paused job is cancelled at once; a running one after its current step (waited for
        a moment). A step outlasting the wait leaves the job `running` with `stop_request` stored: the answer
        says so, and a restart before the step ends cancels the job instead of resuming it."""
        job = self.get(job_id)
        if job.finished:
            raise Conflict(f"job {job_id} already {job.status}", param="fine_tuning_job_id", code="job_finished")
        running = self._running.get(job.spec.target_model)
        if running is not None and running[0] == job_id:
            self._request_stop(job_id, running[2], "cancel")
            self._event(job_id, "cancel requested: the job stops after its current step")
            await asyncio.wait({running[1]}, timeout=STOP_WAIT_S)
        else:
            self._finish(job_id, "cancelled", "cancelled before it ran" if job.iteration == 0 else "cancelled")
        return self.get(job_id)

    async def pause(self, job_id: str) -> JobRecord:
        job = self.get(job_id)
        if job.status not in {"queued", "running", "validating_files"}:
            raise Conflict(f"job {job_id} is {job.status}; only a queued or running job can be paused",
                           param="fine_tuning_job_id", code="job_not_running")
        if job.stop_request == "cancel":
            raise Conflict(f"job {job_id} is being cancelled (after its current step); it cannot be paused",
                           param="fine_tuning_job_id", code="job_cancelling")
        running = self._running.get(job.spec.target_model)
        if running is not None and running[0] == job_id:
            self._request_stop(job_id, running[2], "pause")
            self._event(job_id, "pause requested: the job pauses after its current step")
            await asyncio.wait({running[1]}, timeout=STOP_WAIT_S)
        else:
            self.store.update(job_id, status="paused")
            self._event(job_id, "paused")
        return self.get(job_id)

    def _request_stop(self, job_id: str, stop: StopFlag, what: Literal["cancel", "pause"]) -> None:
        """Signal the runner and store the request, so that a restart before the step ends still honours it."""
        stop.request(what)
        self.store.update(job_id, stop_request=stop.requested)

    def resume(self, job_id: str) -> JobRecord:
        job = self.get(job_id)
        if job.status != "paused":
            raise Conflict(f"job {job_id} is {job.status}; only a paused job can be resumed",
                           param="fine_tuning_job_id", code="job_not_paused")
        self.store.update(job_id, status="queued", stop_request=None)
        self._event(job_id, f"resumed: queued to continue from iteration {job.iteration}")
        self._schedule(job.spec.target_model)
        return self.get(job_id)

    # ----------------------------------------------------------------------------------- events

    def events(self, job_id: str, *, after: str | None, limit: int) -> tuple[list[EventRecord], bool]:
        """Newest first, as OpenAI lists them; `after` is the last event id of the previous page."""
        self.get(job_id)
        seq = _event_seq(after) if after is not None else None
        events = self.store.events(job_id, after_seq=seq, limit=limit + 1, newest_first=True)
        return events[:limit], len(events) > limit

    def all_events(self, job_id: str) -> Iterator[EventRecord]:
        """Every event so far, oldest first (read a page at a time)."""
        self.get(job_id)
        seq = 0
        while batch := self.store.events(job_id, after_seq=seq, limit=1000):
            for event in batch:
                seq = event.seq
                yield event

    def checkpoints(self, job_id: str, *, after: str | None, limit: int) -> tuple[list[CheckpointRecord], bool]:
        """Newest first, as OpenAI lists them; `after` is the last checkpoint id of the previous page (an
        unknown one leaves nothing after it)."""
        self.get(job_id)
        checkpoints = self.store.checkpoints(job_id)
        if after is not None:
            ids = [c.id for c in checkpoints]
            checkpoints = checkpoints[ids.index(after) + 1:] if after in ids else []
        return checkpoints[:limit], len(checkpoints) > limit

    async def follow(self, job_id: str, *, after: str | None = None) -> AsyncIterator[EventRecord | JobRecord]:
        """Every event oldest first, waiting for new ones, then the finished job itself."""
        self.get(job_id)
        seq = _event_seq(after) if after is not None else 0
        while True:
            changed = self._changed.setdefault(job_id, asyncio.Event())
            events = self.store.events(job_id, after_seq=seq, limit=500)
            for event in events:
                seq = event.seq
                yield event
            if events:
                continue
            job = self.get(job_id)
            if job.finished or (job.status == "paused" and job_id not in self.running_jobs()):
                yield job
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), FOLLOW_POLL_S)

    # ---------------------------------------------------------------------------------- running

    def _schedule(self, model: str) -> None:
        if self._closed or model in self._running:
            return
        queued = [j for j in self.store.unfinished() if j.spec.target_model == model and j.status == "queued"]
        if not queued:
            return
        job = queued[0]
        stop = StopFlag()
        task = asyncio.create_task(self._run(job.id, stop), name=f"job-{job.id}")
        self._running[model] = (job.id, task, stop)

    async def _run(self, job_id: str, stop: StopFlag) -> None:
        job = self.store.update(job_id, status="running")
        if job.stop_request is not None:  # requested between scheduling and this start: the store keeps it
            stop.request(job.stop_request)
        model = job.spec.target_model
        self._event(job_id, "started" if job.iteration == 0 else f"running from iteration {job.iteration}")
        for observer in self.config_observers:
            observer(model, job_id, train_config(job.spec))
        reward = JobReward(job.spec.reward, self.sandbox, self.judge, self.scorer, self.compute, owner=job_id) \
            if job.spec.reward is not None else None
        try:
            if runs_user_code(job.spec.reward):  # e.g. created before a restart without --unsafe-user-code
                self.sandbox.require()
            outcome = await JobRunner(self.store, job_id, self.server, reward, stop).run()
        except asyncio.CancelledError:
            raise  # shutdown: the status stays `running` and the next start resumes the job
        except JobFailed as failed:
            self._finish(job_id, "failed", str(failed), code=failed.code)
        except SandboxUnavailable as refused:
            self._finish(job_id, "failed", refused.message, code="sandbox_unavailable")
        except Exception as error:  # a bug: fail this job with its name, keep the server and the queue going
            log.exception("job %s crashed", job_id)
            self._finish(job_id, "failed", f"internal error: {type(error).__name__}: {error}", code="internal_error")
        else:
            if outcome == "paused":
                self.store.update(job_id, status="paused", stop_request=None)
                self._event(job_id, f"paused after iteration {self.store.get(job_id).iteration}")
            else:
                self._finish(job_id, outcome, "the job succeeded" if outcome == "succeeded" else "cancelled")
        finally:
            if self._running.get(model, ("",))[0] == job_id:
                del self._running[model]
            self._schedule(model)
            await self.sandbox.release(job_id)  # its warm workers hold its code's state: never another job's

    def _finish(self, job_id: str, status: Literal["succeeded", "failed", "cancelled"], message: str,
                *, code: str | None = None) -> None:
        fields: dict[str, Any] = {"status": status, "stop_request": None}
        if status == "failed":
            fields["error"] = {"code": code or "job_failed", "message": message, "param": None}
        self.store.update(job_id, **fields)
        self._event(job_id, message, level="error" if status == "failed" else "info")
        assert self.store.get(job_id).status in FINISHED

    def _event(self, job_id: str, message: str, *, level: Literal["info", "warn", "error"] = "info") -> None:
        self.store.add_event(job_id, message, level=level)

    def notify(self, job_id: str) -> None:
        """Wake the followers of a job (called after every event the job writes)."""
        event = self._changed.pop(job_id, None)
        if event is not None:
            event.set()


def _event_seq(event_id: str) -> int:
    seq = event_seq(event_id)
    if seq is None:
        raise InvalidRequest(f"{event_id!r} is not an event id (ftevent-N)", param="after", code="invalid_cursor")
    return seq

