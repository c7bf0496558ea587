"""One `/_train_model` job: validate, build the batch, train, commit the step, hot-swap, record history.

Everything that can be rejected is checked in `prepare()` before any work starts, so a bad request gets a
4xx and changes nothing. `start()` runs the job as its own asyncio task: the HTTP stream only listens,
so a client that disconnects neither cancels the job nor corrupts anything. On any failure the staging
directory is discarded and the previous step stays served. `shutdown()` (the server is stopping) cancels
running jobs: each stream ends with an `error` line (code `server_shutting_down`), so no open stream holds
up the server's exit until a job would have ended.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel

from artlike.types import (
    DoneEvent,
    DPOConfig,
    ErrorEvent,
    GroupObjectiveConfig,
    PPOConfig,
    RecordedExample,
    RecordedPair,
    RewardModelConfig,
    SFTConfig,
    StartEvent,
    StatusEvent,
    StepEvent,
    TrainConfig,
    TrainRequest,
    TrajectoryRef,
)

from ..completion_log import CompletionLog, ReadLimitExceeded
from ..engine.client import EngineRequestError
from ..errors import Conflict, InvalidRequest, NotFound, ServiceUnavailable
from ..metrics import Metrics
from ..models.manager import AdapterRefused, ModelManager, served_name
from ..models.store import ModelStore
from ..trainer_ipc import protocol
from ..trainer_ipc.batch_file import write_batch
from ..trainer_ipc.sequences import TrainSequence
from ..trainer_ipc.steps import count_gradient_steps, units_of
from .batches import BatchContext, Records, builder_for
from .diagnostics import GroupStatistics, SampleStatistics, group_statistics, sample_statistics
from .tokenizer_service import TokenizerService
from .trainer_client import TrainerCrashed, TrainerError, TrainerProcess, TrainerTimeout

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 10.0
SHUTDOWN_WAIT_SECONDS = 30.0  # for cancelled jobs to clean up (the trainer is killed at once, not waited for)
SHUTTING_DOWN = "server_shutting_down"
_STREAM_END = None


@dataclass(frozen=True)
class TrainingLimits:
    """What one /_train_model request may ask for (settings.py; 400 beyond)."""

    max_records: int = 16_384  # recorded completions read from the log
    max_bytes: int = 128 * 1024 * 1024  # their stored token ids + logprobs
    max_sequence_tokens: int = 4096  # one training sequence (the engine's max_model_len by default)
    max_gradient_steps: int = 1024  # epochs x gradient steps


@dataclass
class PreparedJob:
    model: str
    from_step: int
    config: TrainConfig
    sequences: list[TrainSequence]
    trajectories: int
    groups: int
    groups_skipped: int
    rewards: list[float]
    metrics: dict[str, float]
    num_gradient_steps: int
    reference_adapter_dir: Path | None = None  # the step a DPO config's `reference` names
    reward_model_dir: Path | None = None  # the reward model step a PPO config's `reward_model` names
    promote: bool = True  # move the alias to the new step (False: commit it as name@N only)
    annotations: dict[str, Any] = field(default_factory=dict)  # recorded in the history line
    trajectory_rewards: list[tuple[str, float]] = field(default_factory=list)  # recorded ones, for observers
    group_stats: GroupStatistics | None = None  # rewarded groups: zero variance, pass distribution
    sample_stats: SampleStatistics | None = None  # rewarded groups: response length, sampling entropy

    @cached_property  # summed once: a large batch has millions of tokens, and the event loop reads this
    def trainable_tokens(self) -> int:
        return sum(s.num_trainable_tokens for s in self.sequences)


@dataclass
class RunningJob:
    prepared: PreparedJob
    started: float = field(default_factory=time.monotonic)
    stage: str = "queued"
    events: asyncio.Queue[BaseModel | None] = field(default_factory=asyncio.Queue)
    task: asyncio.Task[None] | None = None
    cancelled_for: str | None = None  # set with task.cancel(): the error code the stream reports

    def emit(self, event: BaseModel) -> None:
        self.events.put_nowait(event)

    async def stream(self) -> AsyncIterator[BaseModel]:
        """The job's events, with a `status` heartbeat whenever nothing happened for a while."""
        while True:
            try:
                event = await asyncio.wait_for(self.events.get(), HEARTBEAT_SECONDS)
            except TimeoutError:
                yield StatusEvent(stage=self.stage, message="still working",
                                  elapsed_seconds=round(time.monotonic() - self.started, 1))
                continue
            if event is _STREAM_END:
                return
            yield event


class TrainingService:
    def __init__(
        self,
        store: ModelStore,
        models: ModelManager,
        completion_log: CompletionLog,
        trainer: TrainerProcess,
        metrics: Metrics,
        tokenizer: TokenizerService,
        limits: TrainingLimits = TrainingLimits(),
    ) -> None:
        self.store = store
        self.models = models
        self.completion_log = completion_log
        self.trainer = trainer
        self.metrics = metrics
        self.tokenizer = tokenizer  # for offline trajectories
        self._active: dict[str, RunningJob] = {}
        self._sessions: dict[str, str] = {}  # model -> the training session open on it (sessions.py)
        self._shutting_down = False
        self.limits = limits
        # Called after each committed step with (model, step, [(trajectory id, reward)]); must not raise.
        self.step_observers: list[Callable[[str, int, list[tuple[str, float]]], None]] = []

    def _notify_observers(self, model: str, step: int, rewards: list[tuple[str, float]]) -> None:
        for observer in self.step_observers:
            try:
                observer(model, step, rewards)
            except Exception:  # an observer (a log writer) never fails a committed step
                log.exception("a step observer failed for %s@%d", model, step)

    def is_training(self, model: str) -> bool:
        return model in self._active

    def reserve_for_session(self, model: str, session_id: str) -> None:
        """Keep jobs off `model` while a training session is open on it; Conflict if a job runs or another
        session holds it."""
        if self.is_training(model):
            raise Conflict(f"model {model!r} is training (a /_train_model job); open the session after it ends",
                           param="model", code="training_in_progress")
        if model in self._sessions:
            raise Conflict(f"model {model!r} already has an open training session ({self._sessions[model]}); "
                           "end it first", param="model", code="session_open")
        self._sessions[model] = session_id

    def release_session(self, model: str) -> None:
        self._sessions.pop(model, None)

    def _refuse_if_session(self, model: str) -> None:
        if model in self._sessions:
            raise Conflict(f"model {model!r} has an open training session ({self._sessions[model]}); end it "
                           "(DELETE /v1/training_sessions/{id}) before a /_train_model job", param="model",
                           code="session_open")

    def active(self) -> list[str]:
        return sorted(self._active)

    # ------------------------------------------------------------------------------ checks

    async def prepare(self, request: TrainRequest) -> PreparedJob:
        self.store.require(request.model)
        if self.is_training(request.model):
            raise Conflict(f"model {request.model!r} is already training; wait for its job to finish",
                           param="model", code="training_in_progress")
        self._refuse_if_session(request.model)
        from_step = self.models.latest_step(request.model)
        if from_step is None:
            raise NotFound(f"model {request.model!r} has no servable step", param="model", code="model_not_found")

        config = request.config
        data_param = "examples" if isinstance(config, SFTConfig) else "pairs" if isinstance(config, DPOConfig) \
            else ("pairs" if request.pairs else "scored") if isinstance(config, RewardModelConfig) else "groups"
        self._check_kind(request.model, config)
        reference_adapter_dir = self.reference_step(request.model, config)
        reward_model_dir = self.reward_model_step(request.model, config)
        self._check_rewards(request, reward_model_dir is not None)
        keys = _recorded_keys(request)
        if len(set(keys)) != len(keys) and not isinstance(config, DPOConfig | RewardModelConfig):  # pairs may share
            # Counted in one pass: a body may hold hundreds of thousands of ids.
            dup = next(k for k, count in Counter(keys).items() if count > 1)
            raise InvalidRequest(f"trajectory {dup[0]!r} appears more than once", param=data_param,
                                 code="duplicate_trajectory")
        ids = list(dict.fromkeys(tid for tid, _ in keys))
        try:
            # Without request bodies, and refused before anything is loaded when over the limits.
            records = await self.completion_log.read_for_training(
                ids, max_records=self.limits.max_records, max_bytes=self.limits.max_bytes)
        except ReadLimitExceeded as error:
            raise InvalidRequest(f"{error}; train on fewer or shorter trajectories per request",
                                 param=data_param, code="training_data_too_large") from None
        missing = [i for i in ids if not records.get(i)]
        if missing:
            shown = ", ".join(repr(i) for i in missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise NotFound(f"{len(missing)} trajectory id(s) have no recorded completions: {shown}",
                           param=data_param, code="trajectory_not_found")

        # Tokenizing offline trajectories and merging turns is CPU work: off the event loop.
        head = self.store.require(request.model).reward_head
        context = BatchContext(self.tokenizer, self.limits.max_sequence_tokens,
                               reward_objectives=head.num_objectives if head is not None else 1)
        batch = await asyncio.to_thread(builder_for(request), request, records, context)
        diagnostics = await asyncio.to_thread(_group_diagnostics, request, records)
        sequences, skipped = batch.sequences, batch.groups_skipped
        if request.groups and skipped == len(request.groups):
            split = ""
            if diagnostics is not None and diagnostics[0].groups == skipped:
                stats = diagnostics[0]
                split = (f" ({stats.all_wrong} with no trajectory passing, {stats.all_right} with every one passing, "
                         f"by pass_threshold {stats.pass_threshold:g})")
            raise InvalidRequest(
                f"all {skipped} group(s) have equal rewards within the group{split}, so every advantage is 0 and "
                "there is nothing to learn; vary the rollouts (temperature, more samples per group) or the reward",
                param="groups", code="no_signal")
        if not sequences:
            raise InvalidRequest("no trainable tokens: every completion was masked (e.g. mask_truncated and all "
                                 "completions hit max_tokens)", param=data_param, code="no_trainable_tokens")
        units = units_of([s.group_index for s in sequences], [s.preference for s in sequences])
        num_gradient_steps = count_gradient_steps(len(units), request.config)
        if num_gradient_steps > self.limits.max_gradient_steps:
            raise InvalidRequest(
                f"this job would make {num_gradient_steps} optimizer steps (epochs x gradient_steps_per_epoch, "
                f"at most one step per sequence), over this server's limit of {self.limits.max_gradient_steps} "
                "(--max-gradient-steps)", param="config.epochs", code="too_many_gradient_steps")
        return PreparedJob(
            model=request.model, from_step=from_step, config=request.config, sequences=sequences,
            trajectories=len(request.examples) + 2 * len(request.pairs) + len(request.scored)
            + sum(len(g.trajectories) for g in request.groups),
            groups=len(request.groups),
            groups_skipped=skipped, rewards=batch.rewards,
            metrics={k: statistics.fmean(v) for k, v in batch.metrics.items()},
            num_gradient_steps=num_gradient_steps, reference_adapter_dir=reference_adapter_dir,
            reward_model_dir=reward_model_dir, promote=request.promote, annotations=dict(request.annotations),
            trajectory_rewards=[(t.trajectory_id, t.reward) for g in request.groups for t in g.trajectories
                                if isinstance(t, TrajectoryRef) and t.reward is not None],
            group_stats=diagnostics[0] if diagnostics else None, sample_stats=diagnostics[1] if diagnostics else None,
        )

    def _check_kind(self, model: str, config: TrainConfig) -> None:
        """A reward model trains with objective "reward_model" and nothing else does."""
        is_reward_model = self.store.require(model).kind == "reward"
        if is_reward_model and not isinstance(config, RewardModelConfig):
            raise InvalidRequest(f"{model!r} is a reward model: train it with objective 'reward_model' (preference "
                                 "pairs or scored examples)", param="config.objective", code="wrong_model_kind")
        if not is_reward_model and isinstance(config, RewardModelConfig):
            raise InvalidRequest(f"objective 'reward_model' trains a reward model; {model!r} is a policy (register "
                                 "a model with kind 'reward')", param="model", code="wrong_model_kind")

    def _check_rewards(self, request: TrainRequest, scored_by_a_model: bool) -> None:
        """Every trajectory needs its reward, unless PPO's reward model scores it."""
        if scored_by_a_model:
            return
        for g, group in enumerate(request.groups):
            for i, trajectory in enumerate(group.trajectories):
                if trajectory.reward is None:
                    hint = " or name a `reward_model` that scores the sequences" if isinstance(
                        request.config, PPOConfig) else ""
                    raise InvalidRequest(f"groups[{g}].trajectories[{i}] has no reward: give every trajectory a "
                                         f"`reward`{hint}", param=f"groups[{g}].trajectories[{i}].reward",
                                         code="missing_reward")

    def reward_model_step(self, model: str, config: TrainConfig) -> Path | None:
        """The adapter directory of the reward model step a PPO config names; 4xx when it cannot be used."""
        if not isinstance(config, PPOConfig) or config.reward_model is None:
            return None
        served = self.models.resolve_reward_model(config.reward_model)
        assert served.model is not None and served.step is not None
        if self.store.require(served.model).base_model != self.store.require(model).base_model:
            raise InvalidRequest(f"the reward model {config.reward_model!r} is on another base model",
                                 param="config.reward_model", code="invalid_reward_model")
        return self.store.step_dir(served.model, served.step)

    def reference_step(self, model: str, config: protocol.PassConfig) -> Path | None:
        """The adapter directory of the step a DPO config names as its reference; 4xx when it cannot be used."""
        if not isinstance(config, DPOConfig) or config.reference is None:
            return None
        name, _, number = config.reference.rpartition("@")
        reference_model = self.store.get(name)
        if reference_model is None or int(number) not in self.store.committed_steps(name):
            raise NotFound(f"the reference step {config.reference!r} does not exist", param="config.reference",
                           code="reference_not_found")
        if reference_model.base_model != self.store.require(model).base_model:
            raise InvalidRequest(f"the reference {config.reference!r} is an adapter of another base model",
                                 param="config.reference", code="invalid_reference")
        return self.store.step_dir(name, int(number))

    # --------------------------------------------------------------------------------- run

    def start(self, prepared: PreparedJob) -> RunningJob:
        if self._shutting_down:
            raise ServiceUnavailable("the server is shutting down; retry against its next start",
                                     code=SHUTTING_DOWN)
        if self.is_training(prepared.model):  # re-checked: another request may have started meanwhile
            raise Conflict(f"model {prepared.model!r} is already training", param="model",
                           code="training_in_progress")
        self._refuse_if_session(prepared.model)
        job = RunningJob(prepared)
        self._active[prepared.model] = job
        job.task = asyncio.create_task(self._run(job), name=f"train:{prepared.model}")
        return job

    async def shutdown(self, timeout_s: float = SHUTDOWN_WAIT_SECONDS) -> None:
        """Refuse new jobs, cancel the running ones and wait (at most `timeout_s`) until each has cleaned up
        and ended its stream. Idempotent."""
        self._shutting_down = True
        jobs = [job for job in self._active.values() if job.task is not None]
        for job in jobs:
            log.warning("server shutting down: cancelling the training job for %s", job.prepared.model)
            job.cancelled_for = SHUTTING_DOWN
            assert job.task is not None
            job.task.cancel()
        if jobs:
            await asyncio.wait([job.task for job in jobs if job.task is not None], timeout=timeout_s)

    async def _run(self, job: RunningJob) -> None:
        p = job.prepared
        staging: Path | None = None
        try:
            job.emit(StartEvent(
                model=p.model, from_step=p.from_step, num_gradient_steps=p.num_gradient_steps,
                trajectories=p.trajectories, groups=p.groups, groups_skipped=p.groups_skipped,
                sequences=len(p.sequences), trainable_tokens=p.trainable_tokens,
                reward_mean=statistics.fmean(p.rewards) if p.rewards else None,
                reward_std=statistics.pstdev(p.rewards) if p.rewards else None,
                **_diagnostic_fields(p),
            ))
            staging = self.store.new_staging_dir(p.model)
            batch_path = staging.with_suffix(".batch")
            await asyncio.to_thread(write_batch, batch_path, p.sequences)
            job.stage = "training"
            job.emit(StatusEvent(stage="training", message=f"{len(p.sequences)} sequences, "
                                 f"{p.trainable_tokens} trainable tokens"))
            steps: list[StepEvent] = []
            train_started = time.perf_counter()
            events = self.trainer.train(
                model_name=p.model,
                adapter_dir=self.store.step_dir(p.model, p.from_step),
                out_dir=staging,
                batch_path=batch_path,
                config=p.config,
                reference_adapter_dir=p.reference_adapter_dir,
                reward_model_dir=p.reward_model_dir,
            )
            async with aclosing(events):
                async for event in events:
                    if isinstance(event, protocol.Step):
                        step = event.step_event()
                        steps.append(step)
                        self.metrics.training_step(step.tokens, step.seconds)
                        job.emit(step)
            train_seconds = time.perf_counter() - train_started
            batch_path.unlink(missing_ok=True)

            job.stage = "swapping"
            # Renamed into place as the next step, served, verified, then committed by its history line;
            # on any failure the previous step stays served (ModelManager.commit_step).
            committed = await self.models.commit_step(
                p.model, staging, lambda step, swap: _history_entry(p, step, steps, train_seconds, swap),
                promote=p.promote)
            staging = None
            self._notify_observers(p.model, committed.step, p.trajectory_rewards)
            job.emit(DoneEvent(model=served_name(p.model, committed.step), step=committed.step,
                               adapter_path=str(committed.adapter_path), train_seconds=round(train_seconds, 3),
                               swap_seconds=round(committed.swap_seconds, 4)))
        except asyncio.CancelledError:
            if job.cancelled_for is None:  # not ours to report
                raise
            served = self.models.latest_step(p.model)
            job.emit(ErrorEvent(message=f"the server is shutting down: the job was cancelled; step {served} "
                                "stays served", code=job.cancelled_for, served_step=served))
        except (TrainerCrashed, TrainerError, TrainerTimeout) as error:
            log.warning("training %s failed: %s", p.model, error)
            job.emit(ErrorEvent(message=str(error), code=_error_code(error),
                                served_step=self.models.latest_step(p.model)))
        except (httpx.TransportError, EngineRequestError, AdapterRefused) as error:
            log.warning("publishing the new step of %s failed: %s", p.model, error)
            job.emit(ErrorEvent(message=f"the engine did not take the new step, so it was not committed: {error}",
                                code="engine_unavailable", served_step=self.models.latest_step(p.model)))
        except Exception as error:  # a bug: log the traceback, tell the client, keep serving the old step
            log.exception("training job for %s crashed", p.model)
            job.emit(ErrorEvent(message=f"internal error: {type(error).__name__}: {error}", code="internal_error",
                                served_step=self.models.latest_step(p.model)))
        finally:
            if staging is not None:
                self.store.discard_staging(staging)
                staging.with_suffix(".batch").unlink(missing_ok=True)
            del self._active[p.model]
            job.emit(_STREAM_END)  # type: ignore[arg-type]


def _recorded_keys(request: TrainRequest) -> list[tuple[str, tuple[int, ...] | None]]:
    """What a request trains on, in order: (recorded trajectory id, the completions chosen of it or None for
    all). A DPO answer may appear in several pairs; one trajectory may appear once per choice of completions."""
    if isinstance(request.config, SFTConfig):
        return [(e.trajectory_id, None) for e in request.examples if isinstance(e, RecordedExample)]
    if isinstance(request.config, DPOConfig | RewardModelConfig):
        keys: list[tuple[str, tuple[int, ...] | None]] = [
            (tid, None if cid is None else (cid,)) for p in request.pairs if isinstance(p, RecordedPair)
            for tid, cid in ((p.chosen_trajectory_id, p.chosen_completion_id),
                             (p.rejected_trajectory_id, p.rejected_completion_id))]
        return keys + [(e.trajectory_id, None if e.completion_id is None else (e.completion_id,))
                       for e in request.scored if e.trajectory_id is not None]
    return [(t.trajectory_id, None if t.completion_ids is None else tuple(sorted(t.completion_ids)))
            for g in request.groups for t in g.trajectories if isinstance(t, TrajectoryRef)]


def _group_diagnostics(request: TrainRequest, records: Records
                       ) -> tuple[GroupStatistics, SampleStatistics] | None:
    """What a rewarded-group or PPO job's data says about its signal (`diagnostics.py`); None for other jobs."""
    config = request.config
    if not isinstance(config, GroupObjectiveConfig | PPOConfig):
        return None
    groups = group_statistics([[t.reward for t in g.trajectories] for g in request.groups], config.pass_threshold)
    recorded = [t.trajectory_id for g in request.groups for t in g.trajectories if isinstance(t, TrajectoryRef)]
    samples = sample_statistics([[lp for c in records[tid] for lp in c.logprobs] for tid in recorded])
    return groups, samples


def _diagnostic_fields(p: PreparedJob) -> dict[str, Any]:
    """The start event's (and history line's) diagnostics of the job's groups; {} for other jobs."""
    fields: dict[str, Any] = {}
    if p.group_stats is not None and p.group_stats.groups:
        g = p.group_stats
        fields.update(zero_variance_fraction=g.zero_variance_fraction, groups_all_wrong=g.all_wrong,
                      groups_mixed=g.mixed, groups_all_right=g.all_right, pass_rate=g.pass_rate)
    if p.sample_stats is not None:
        fields.update(response_tokens_mean=p.sample_stats.response_tokens_mean,
                      sampling_entropy=p.sample_stats.sampling_entropy)
    return {key: value for key, value in fields.items() if value is not None}


def _error_code(error: Exception) -> str:
    return {TrainerCrashed: "trainer_crashed", TrainerTimeout: "trainer_timeout"}.get(type(error), "trainer_error")


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {"mean": statistics.fmean(values), "std": statistics.pstdev(values), "min": min(values),
            "max": max(values)}


def _history_entry(p: PreparedJob, step: int, steps: list[StepEvent], train_seconds: float,
                   swap_seconds: float) -> dict[str, Any]:
    kl_to_base = [s.kl_to_base for s in steps if s.kl_to_base is not None]  # measured steps only
    return {
        "step": step,
        "from_step": p.from_step,
        "time": time.time(),
        "reward": _stats(p.rewards),
        "trajectories": p.trajectories,
        "groups": p.groups,
        "groups_skipped": p.groups_skipped,
        "sequences": len(p.sequences),
        "trainable_tokens": p.trainable_tokens,
        "gradient_steps": len(steps),
        "loss": _stats([s.loss for s in steps]),
        "kl": _stats([s.kl for s in steps]),
        "entropy": _stats([s.entropy for s in steps]),
        **({"kl_to_base": _stats(kl_to_base)} if kl_to_base else {}),
        **_diagnostic_fields(p),
        "grad_norm": _stats([s.grad_norm for s in steps]),
        "clip_fraction": _stats([s.clip_fraction for s in steps]),
        "logprob_mismatch": steps[0].logprob_mismatch if steps else None,
        "metrics": p.metrics,
        "objective_metrics": steps[-1].metrics if steps else {},  # the last step's (PPO's scores, a reward model's accuracy)
        "config": p.config.model_dump(),
        "train_seconds": round(train_seconds, 3),
        "swap_seconds": round(swap_seconds, 4),
        "promoted": p.promote,
        **({"annotations": p.annotations} if p.annotations else {}),
    }
