"""The Tinker API's logic over this server's parts: a Tinker training run is a trainable model with an open
training session, its checkpoints are the model's steps, its samplers are `name@N` on the engine.

No FastAPI here (`router.py` is the HTTP glue). Operations the SDK treats as futures run in the background
and are polled through `FutureTable`; one run's operations run in the SDK's order (`OrderedQueues`), and
runs never wait for each other here: their passes queue at the one trainer process, their samples go to the
engine, so one run's long `forward_backward` never holds back another run's sampling.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from artlike.session_types import (
    AdamParams,
    LoadStateRequest,
    OpenSessionRequest,
    OptimStepRequest,
    SaveStateRequest,
)
from artlike.types import LoraConfig, RegisterModelRequest

from ..errors import InvalidRequest, NotFound
from ..models.manager import ModelManager, served_name
from ..models.registry import ModelRegistry
from ..models.store import ModelStore
from ..openai_api.serving import OpenAIServing
from ..state import BaseModelInfo
from ..training.sessions import TrainingSessions
from . import paths
from .datums import datum_sequences, loss_config
from .futures import FutureTable, OrderedQueues, Outcome
from .requests import (
    CreateModelBody,
    CreateSamplingSessionBody,
    CreateSessionBody,
    LoadWeightsBody,
    OptimStepBody,
    SampleBody,
    SaveWeightsBody,
)
from .runs import Checkpoint, Run, RunStore
from .sampling import sample
from .wire import WireError, decode_forward_backward, encode_forward_backward_output, encode_sample_response

log = logging.getLogger(__name__)

OPTIMIZER_STATE = "optimizer.pt"
"""The file the trainer writes AdamW's state to beside a saved step's adapter."""
SESSION_IDLE_TIMEOUT_S = 3600.0
"""A run's training session ends after this long unused; its saved checkpoints stay."""


@dataclass
class _Session:
    id: str
    created_at: float
    user_metadata: dict[str, str]
    runs: set[str] = field(default_factory=set)
    samplers: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class Sampler:
    id: str
    base_model: str
    served_model: str  # what the engine serves: `name@N` or the base model
    model_path: str | None = None


class TinkerService:
    def __init__(self, *, base: BaseModelInfo, data_dir: Path, store: ModelStore, models: ModelManager,
                 registry: ModelRegistry, sessions: TrainingSessions, serving: OpenAIServing,
                 futures: FutureTable | None = None) -> None:
        self.base = base
        self.store = store
        self.models = models
        self.registry = registry
        self.sessions = sessions
        self.serving = serving
        self.futures = futures or FutureTable()
        self.queues = OrderedQueues(self.futures)
        self.runs = RunStore(data_dir)
        self._sessions: dict[str, _Session] = {}
        self._training: dict[str, str] = {}  # run id -> the training session open on its model
        self._samplers: dict[str, Sampler] = {}

    async def stop(self) -> None:
        await self.queues.stop()
        await self.futures.stop()

    # ------------------------------------------------------------------------------ sessions

    def client_config(self) -> dict[str, Any]:
        """What the SDK asks before anything else: plain httpx, key auth, no server-side extensions."""
        return {"pjwt_auth_enabled": False, "use_pyqwest_transport": False, "proto_compress_fwdbwd": False,
                "sample_use_retrieve_futures": False, "custom_loss_server_side": False,
                "sample_join_sampling_session": False}

    def capabilities(self) -> dict[str, Any]:
        return {"supported_models": [{"model_name": self.base.name}]}

    def create_session(self, body: CreateSessionBody) -> dict[str, Any]:
        session = _Session(paths.new_session_id(), time.time(), dict(body.user_metadata or {}))
        self._sessions[session.id] = session
        return {"session_id": session.id, "type": "create_session"}

    def heartbeat(self, session_id: str) -> dict[str, Any]:
        """Acknowledged: a run's training session ends by its idle timeout or `finish`, not by heartbeats."""
        return {"type": "session_heartbeat"}

    async def finish_session(self, session_id: str) -> dict[str, Any]:
        """End the session's training sessions (their checkpoints stay) and forget its samplers."""
        session = self._sessions.pop(session_id, None)
        if session is None:
            return {}
        for run in session.runs:
            await self._end_training(run)
        for sampler in session.samplers:
            self._samplers.pop(sampler, None)
        return {}

    def describe_session(self, session_id: str) -> dict[str, Any]:
        session = self._session(session_id)
        return {"training_run_ids": sorted(session.runs), "sampler_ids": sorted(session.samplers),
                "user_metadata": session.user_metadata}

    def _session(self, session_id: str) -> _Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise NotFound(f"no session {session_id!r} on this server (it ended, or the server restarted): make "
                           "a new ServiceClient", param="session_id", code="session_not_found")
        return session

    # ---------------------------------------------------------------------------------- runs

    def create_model(self, body: CreateModelBody) -> dict[str, Any]:
        session = self._session(body.session_id)
        run_id = paths.run_id(session.id, body.model_seq_id)
        self._check_base(body.base_model)
        if not (body.lora_config.train_attn or body.lora_config.train_mlp):
            raise InvalidRequest("this server's LoRA trains attention and MLP layers: set train_attn or train_mlp",
                                 param="lora_config", code="unsupported_lora")

        async def work() -> dict[str, Any]:
            rank = body.lora_config.rank
            await self.registry.register(RegisterModelRequest(
                name=paths.model_name(run_id), base_model=self.base.name,
                lora=LoraConfig(rank=rank, alpha=2.0 * rank)))
            run = Run(run_id=run_id, base_model=self.base.name, lora_rank=rank, created_at=time.time(),
                      last_request_time=time.time(), user_metadata=dict(body.user_metadata or {}))
            await asyncio.to_thread(self.runs.add, run)
            await self._open_training(run, step=0)
            session.runs.add(run_id)
            return {"model_id": run_id, "type": "create_model"}

        return {"request_id": self.futures.start(work), "model_id": run_id}

    def get_info(self, model_id: str) -> dict[str, Any]:
        run = self._run(model_id)
        return {"model_id": run.run_id, "type": "get_info", "is_lora": True, "lora_rank": run.lora_rank,
                "model_name": run.base_model,
                "model_data": {"model_name": run.base_model, "arch": "unknown", "tokenizer_id": run.base_model}}

    def _run(self, run_id: str) -> Run:
        paths.model_name(run_id)  # a malformed id is not found either
        run = self.runs.get(run_id)
        if run is None:
            raise NotFound(f"no training run {run_id!r} on this server", param="model_id", code="run_not_found")
        self.runs.touch(run)
        return run

    def _check_base(self, base_model: str | None) -> None:
        if base_model is not None and base_model not in {self.base.name, str(self.base.path)}:
            raise InvalidRequest(f"this server serves base model {self.base.name!r}, not {base_model!r}",
                                 param="base_model", code="base_model_mismatch")

    async def _open_training(self, run: Run, step: int) -> None:
        opened = await self.sessions.open(OpenSessionRequest(
            model=run.model, from_step=step, idle_timeout_s=SESSION_IDLE_TIMEOUT_S,
            optimizer=AdamParams(learning_rate=1e-4, betas=(0.9, 0.95), eps=1e-12, max_grad_norm=None)))
        self._training[run.run_id] = opened.id

    async def _end_training(self, run_id: str) -> None:
        session_id = self._training.pop(run_id, None)
        if session_id is not None:
            with contextlib.suppress(NotFound):  # ended already (idle)
                await self.sessions.close(session_id, reason="its Tinker session finished")

    def _training_session(self, run: Run) -> str:
        session_id = self._training.get(run.run_id)
        if session_id is None:
            raise InvalidRequest(f"run {run.run_id!r} is not open for training in this server process (its "
                                 "session finished, or the server restarted): continue it from a checkpoint with "
                                 "create_training_client_from_state", param="model_id", code="run_not_open")
        return session_id

    # ------------------------------------------------------------------------------ training

    def forward_backward(self, raw: bytes) -> dict[str, Any]:
        try:
            body = decode_forward_backward(raw)
        except WireError as error:
            raise InvalidRequest(f"the forward_backward body is not a Tinker request: {error}",
                                 code="invalid_protobuf") from None
        run = self._run(body.model_id)
        config = loss_config(body.loss_fn, body.loss_fn_config)
        sequences = datum_sequences(body.data, body.loss_fn, vocab_size=None,
                                    max_tokens=self.sessions.training.limits.max_sequence_tokens)

        async def work() -> bytes:
            result = await self.sessions.run_sequences(self._training_session(run), sequences, config,
                                                       backward=not body.forward_only)
            logprobs = [[0.0 if v is None else v for v in s.logprobs[1:]] for s in result.sequences]
            return encode_forward_backward_output(logprobs, {"loss:sum": result.loss})

        return {"request_id": self.queues.submit(run.run_id, body.seq_id, work), "model_id": run.run_id}

    def optim_step(self, body: OptimStepBody) -> dict[str, Any]:
        run = self._run(body.model_id)
        adam = body.adam_params

        async def work() -> dict[str, Any]:
            done = await self.sessions.optim_step(self._training_session(run), OptimStepRequest(
                learning_rate=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                weight_decay=adam.weight_decay, max_grad_norm=adam.grad_clip_norm or None))
            return {"metrics": {"grad_norm:mean": done.grad_norm, "learning_rate:mean": done.learning_rate},
                    "type": "optim_step"}

        return {"request_id": self.queues.submit(run.run_id, body.seq_id, work), "model_id": run.run_id}

    def save_weights(self, body: SaveWeightsBody, *, for_sampler: bool) -> dict[str, Any]:
        """`save_state(name)` (kind weights, with the optimizer's state), `save_weights_for_sampler(name)`
        (kind sampler_weights, served at once) or, for a sampler without a name, a sampler on the new step."""
        run = self._run(body.model_id)
        kind: paths.CheckpointKind = "sampler_weights" if for_sampler else "weights"
        name = None if body.path is None else paths.checkpoint_name(body.path)
        if name is None and not (for_sampler and body.sampling_session_seq_id is not None):
            raise InvalidRequest("save_weights needs a checkpoint name in `path`", param="path",
                                 code="invalid_checkpoint_name")
        session_id = paths.session_of_run(run.run_id)

        async def work() -> dict[str, Any]:
            saved = await self.sessions.save_state(self._training_session(run), SaveStateRequest(serve=for_sampler))
            if name is not None:
                checkpoint = Checkpoint(kind=kind, name=name, step=saved.step, time=time.time(),
                                        user_metadata=dict(body.user_metadata or {}))
                await asyncio.to_thread(self.runs.record_checkpoint, run, checkpoint)
                answer: dict[str, Any] = {"path": str(run.path_of(checkpoint))}
            else:
                answer = {}
            if body.sampling_session_seq_id is not None:
                sampler = self._add_sampler(session_id, body.sampling_session_seq_id,
                                            served_name(run.model, saved.step), answer.get("path"))
                answer["sampling_session_id"] = sampler.id
            return {**answer, "type": "save_weights_for_sampler" if for_sampler else "save_weights"}

        return {"request_id": self.queues.submit(run.run_id, body.seq_id, work), "model_id": run.run_id}

    def load_weights(self, body: LoadWeightsBody) -> dict[str, Any]:
        """A new run made from a checkpoint (`create_training_client_from_state[_with_optimizer]`: `session_id`
        + `model_seq_id`), or, with `model_id`, the checkpoint loaded back into its own run (the deprecated
        `load_state[_with_optimizer]`). `optimizer`: AdamW continues from the state saved with the checkpoint,
        else it starts afresh on the checkpoint's weights."""
        source, checkpoint = self._checkpoint(body.path)
        if body.model_id is not None:
            return self._load_into(body, source, checkpoint)
        if body.session_id is None or body.model_seq_id is None:
            raise InvalidRequest("load_weights needs `session_id` and `model_seq_id` (a new run), or `model_id`",
                                 param="session_id", code="invalid_value")
        self._check_base(body.base_model)
        session = self._session(body.session_id)
        run_id = paths.run_id(session.id, body.model_seq_id)
        source_dir = self.store.step_dir(source.model, checkpoint.step)
        lora = self.store.require(source.model).lora

        async def work() -> dict[str, Any]:
            async def copy_step(staging: Path) -> None:
                await asyncio.to_thread(_copy_adapter, source_dir, staging, with_optimizer=body.optimizer)

            await self.models.register(paths.model_name(run_id), self.base.name, lora, None, copy_step)
            run = Run(run_id=run_id, base_model=self.base.name, lora_rank=source.lora_rank, created_at=time.time(),
                      last_request_time=time.time(),
                      user_metadata=dict(body.user_metadata or source.user_metadata))
            await asyncio.to_thread(self.runs.add, run)
            await self._open_training(run, step=0)
            session.runs.add(run_id)
            return {"model_id": run_id, "path": body.path, "type": "load_weights"}

        return {"request_id": self.futures.start(work), "model_id": run_id}

    def _load_into(self, body: LoadWeightsBody, run: Run, checkpoint: Checkpoint) -> dict[str, Any]:
        if self._run(body.model_id or "").run_id != run.run_id:
            raise InvalidRequest("load_state takes a checkpoint of the same run; make a new training client from "
                                 "another run's checkpoint", param="path", code="other_run")

        async def work() -> dict[str, Any]:
            request = LoadStateRequest(step=checkpoint.step, optimizer=body.optimizer)
            await self.sessions.load_state(self._training_session(run), request)
            return {"path": body.path, "model_id": run.run_id, "type": "load_weights"}

        return {"request_id": self.queues.submit(run.run_id, body.seq_id or 0, work), "model_id": run.run_id}

    def _checkpoint(self, path: str) -> tuple[Run, Checkpoint]:
        parsed = paths.parse_checkpoint_path(path)
        run = self._run(parsed.run)
        checkpoint = run.checkpoint(parsed.kind, parsed.name)
        if checkpoint is None or checkpoint.step not in self.store.committed_steps(run.model):
            raise NotFound(f"no checkpoint {path!r} on this server", param="path", code="checkpoint_not_found")
        return run, checkpoint

    # ------------------------------------------------------------------------------ sampling

    def _add_sampler(self, session_id: str, seq_id: int, served: str, model_path: str | None) -> Sampler:
        sampler = Sampler(id=f"{session_id}:sample:{seq_id}", base_model=self.base.name, served_model=served,
                          model_path=model_path)
        self._samplers[sampler.id] = sampler
        if session_id in self._sessions:
            self._sessions[session_id].samplers.add(sampler.id)
        return sampler

    def create_sampling_session(self, body: CreateSamplingSessionBody) -> dict[str, Any]:
        session = self._session(body.session_id)
        if body.model_path is not None:
            run, checkpoint = self._checkpoint(body.model_path)
            served = served_name(run.model, checkpoint.step)
        elif body.base_model is not None:
            self._check_base(body.base_model)
            served = self.base.name
        else:
            raise InvalidRequest("create_sampling_session needs `model_path` or `base_model`", param="model_path",
                                 code="invalid_value")
        sampler = self._add_sampler(session.id, body.sampling_session_seq_id, served, body.model_path)
        return {"sampling_session_id": sampler.id, "type": "create_sampling_session"}

    def sampler(self, sampler_id: str) -> dict[str, Any]:
        sampler = self._samplers.get(sampler_id)
        if sampler is None:
            raise NotFound(f"no sampler {sampler_id!r}", param="sampler_id", code="sampler_not_found")
        return {"sampler_id": sampler.id, "base_model": sampler.base_model, "model_path": sampler.model_path}

    def asample(self, body: SampleBody) -> dict[str, Any]:
        if body.sampling_session_id is not None:
            found = self._samplers.get(body.sampling_session_id)
            if found is None:
                raise NotFound(f"no sampler {body.sampling_session_id!r} (its session finished, or the server "
                               "restarted)", param="sampling_session_id", code="sampler_not_found")
            served = found.served_model
        elif body.model_path is not None:
            run, checkpoint = self._checkpoint(body.model_path)
            served = served_name(run.model, checkpoint.step)
        else:
            self._check_base(body.base_model or self.base.name)
            served = self.base.name
        request_id = self.futures.new_id()
        trajectory = f"tinker-{request_id}"

        async def work() -> bytes:
            outputs, prompt_logprobs = await sample(self.serving, body, served, trajectory)
            return encode_sample_response(outputs, prompt_logprobs=prompt_logprobs)

        self.futures.start(work, request_id)
        return {"request_id": request_id, "sample_sequence_ids": [f"{trajectory}:{i}" for i in range(body.num_samples)]}

    async def retrieve(self, request_id: str) -> Outcome | None:
        return await self.futures.wait(request_id)

    # ---------------------------------------------------------------------------------- REST

    def training_run(self, run_id: str) -> dict[str, Any]:
        return self._describe(self._run(run_id))

    def _describe(self, run: Run) -> dict[str, Any]:
        checkpoints = self._listed(run)
        last = {kind: next((c for c in reversed(checkpoints) if c["checkpoint_type"] == kind), None)
                for kind in ("training", "sampler")}
        return {"training_run_id": run.run_id, "base_model": run.base_model, "model_owner": "local",
                "is_lora": True, "corrupted": False, "lora_rank": run.lora_rank,
                "last_request_time": _iso(run.last_request_time), "last_checkpoint": last["training"],
                "last_sampler_checkpoint": last["sampler"], "user_metadata": run.user_metadata}

    def training_runs(self, limit: int, offset: int) -> dict[str, Any]:
        runs = self.runs.all()
        page = runs[offset:offset + limit]
        return {"training_runs": [self._describe(run) for run in page],
                "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)}}

    def checkpoints(self, run_id: str) -> dict[str, Any]:
        return {"checkpoints": self._listed(self._run(run_id)), "cursor": None}

    def all_checkpoints(self, limit: int, offset: int) -> dict[str, Any]:
        listed = sorted((c for run in self.runs.all() for c in self._listed(run)), key=lambda c: c["time"],
                        reverse=True)
        return {"checkpoints": listed[offset:offset + limit],
                "cursor": {"offset": offset, "limit": limit, "total_count": len(listed)}}

    async def delete_checkpoint(self, run_id: str, checkpoint_id: str) -> None:
        """Forget the checkpoint and delete its step, unless the step serves the run's model or another
        checkpoint names it (then only the name goes)."""
        run, checkpoint = self._checkpoint(f"tinker://{run_id}/{checkpoint_id}")
        await asyncio.to_thread(self.runs.remove_checkpoint, run, checkpoint)
        if all(c.step != checkpoint.step for c in run.checkpoints):
            await self.models.delete_steps(run.model, [checkpoint.step])

    def weights_info(self, tinker_path: str) -> dict[str, Any]:
        run, _ = self._checkpoint(tinker_path)
        return {"base_model": run.base_model, "is_lora": True, "lora_rank": run.lora_rank,
                "train_unembed": False, "train_mlp": True, "train_attn": True}

    def _listed(self, run: Run) -> list[dict[str, Any]]:
        committed = set(self.store.committed_steps(run.model))
        return [{"checkpoint_id": f"{c.kind}/{c.name}", "checkpoint_type": paths.CHECKPOINT_TYPES[c.kind],
                 "time": _iso(c.time), "tinker_path": str(run.path_of(c)), "public": False,
                 "user_metadata": c.user_metadata or None}
                for c in sorted(run.checkpoints, key=lambda c: c.time) if c.step in committed]


def _copy_adapter(source: Path, target: Path, *, with_optimizer: bool) -> None:
    """A step's adapter files into a new model's staging step 0, its optimizer state only when asked."""
    for path in source.iterdir():
        if path.is_file() and (with_optimizer or path.name != OPTIMIZER_STATE):
            shutil.copy2(path, target / path.name)


def _iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, tz=UTC).isoformat()
