"""`Backend`: every HTTP route the client calls, written once, async, with typed answers.

The public objects (`TrainableModel`, `Trajectory`, `TrainingSession`, `Jobs`, `art.score`, the judge)
hold a Backend and never build a request themselves; their `_sync` variants are generated from their
async methods (`_syncify`). How a request travels (auth, timeouts, retries, transports) is `_http`'s job;
which route, which body, whether a retry is safe and how the answer is read is this module's.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel

from ._http import Connection, Multipart
from .job_types import Checkpoint, Job, JobEvent
from .session_types import SessionInfo
from .studio_types import TrajectoryView
from .types import (
    EvaluationRequest,
    ModelInfo,
    RegisterModelRequest,
    RewardsResponse,
    StepInfo,
    TrajectoryRecord,
    UpdateModelRequest,
)

__all__ = ["COMPUTE_TIMEOUT", "Backend"]

_M = TypeVar("_M", bound=BaseModel)

COMPUTE_TIMEOUT = httpx.Timeout(None, connect=10.0)
"""A forward/backward over a large batch may take minutes on a CPU: no read timeout for compute calls."""


class _StepList(BaseModel):
    data: list[StepInfo]


class _DeletedSteps(BaseModel):
    deleted: list[int]
    data: list[StepInfo]


class Backend:
    """One artlike server's routes over one `Connection`."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection

    # ----------------------------------------------------------------------------- trainable models

    async def register_model(self, registration: RegisterModelRequest) -> ModelInfo:
        """Registering the same config twice answers the same model: safe to retry."""
        response = await self.connection.request("POST", "/v1/trainable_models",
                                                 json=registration.model_dump(mode="json"), idempotent=True)
        return ModelInfo.model_validate_json(response.content)

    async def get_model(self, name: str) -> ModelInfo:
        return ModelInfo.model_validate_json((await self.connection.request("GET", _model_path(name))).content)

    async def list_steps(self, name: str) -> list[StepInfo]:
        response = await self.connection.request("GET", _model_path(name, "/steps"))
        return _StepList.model_validate_json(response.content).data

    async def delete_steps(self, name: str, keep: int) -> list[int]:
        response = await self.connection.request("DELETE", _model_path(name, "/steps"), params={"keep": keep})
        return _DeletedSteps.model_validate_json(response.content).deleted

    async def update_model(self, name: str, update: UpdateModelRequest) -> ModelInfo:
        response = await self.connection.request("PATCH", _model_path(name), json=update.model_dump(mode="json"),
                                                 idempotent=True)
        return ModelInfo.model_validate_json(response.content)

    async def log_evaluation(self, name: str, evaluation: EvaluationRequest) -> dict[str, Any]:
        response = await self.connection.request("POST", _model_path(name, "/evaluations"),
                                                 json=evaluation.model_dump(mode="json"))
        return dict(response.json())

    def train_lines(self, body: dict[str, Any], idle_timeout: float) -> AsyncGenerator[str, None]:
        """The NDJSON lines of one training step (`_train`'s stream rules read them). Never retried once
        sent: the step may have started."""
        return self.connection.stream_lines("POST", "/_train_model", json=body, idle_timeout=idle_timeout)

    async def score(self, body: dict[str, Any]) -> RewardsResponse:
        """Scoring changes nothing on the server, so a request that broke off is retried like a GET."""
        response = await self.connection.request("POST", "/v1/rewards", json=body, idempotent=True)
        return RewardsResponse.model_validate_json(response.content)

    async def served_models(self) -> list[str]:
        """The ids `/v1/models` lists, the base model first."""
        response = await self.connection.request("GET", "/v1/models")
        return [str(model["id"]) for model in response.json()["data"]]

    # --------------------------------------------------------------------------------- trajectories

    async def get_trajectory(self, trajectory_id: str) -> TrajectoryRecord:
        response = await self.connection.request("GET", f"/v1/trajectories/{trajectory_id}")
        return TrajectoryRecord.model_validate_json(response.content)

    async def view_trajectory(self, trajectory_id: str) -> TrajectoryView:
        """A recorded trajectory as the server shows it: prompt messages and decoded answers."""
        response = await self.connection.request("GET", f"/v1/trajectories/{trajectory_id}/view")
        return TrajectoryView.model_validate_json(response.content)

    # ---------------------------------------------------------------------------- training sessions

    async def open_session(self, body: dict[str, Any]) -> SessionInfo:
        response = await self.connection.request("POST", "/v1/training_sessions", json=body, idempotent=False,
                                                 request_timeout=COMPUTE_TIMEOUT)
        return SessionInfo.model_validate_json(response.content)

    async def session_action(self, session_id: str, action: str, body: dict[str, Any], result: type[_M]) -> _M:
        """One compute call (`forward_backward`, `optim_step`, `save_state`, ...): never retried once sent
        (it would apply twice), and without a read timeout."""
        response = await self.connection.request("POST", _session_path(session_id, action), json=body,
                                                 idempotent=False, request_timeout=COMPUTE_TIMEOUT)
        return result.model_validate_json(response.content)

    async def get_session(self, session_id: str) -> SessionInfo:
        return SessionInfo.model_validate_json((await self.connection.request("GET", _session_path(session_id))).content)

    async def close_session(self, session_id: str) -> SessionInfo:
        response = await self.connection.request("DELETE", _session_path(session_id), idempotent=False)
        return SessionInfo.model_validate_json(response.content)

    # --------------------------------------------------------------- managed jobs (OpenAI's fine-tuning)

    async def upload_file(self, upload: Multipart) -> str:
        """The new file's id."""
        return str((await self.connection.request("POST", "/v1/files", multipart=upload)).json()["id"])

    async def create_job(self, body: dict[str, Any]) -> Job:
        return Job.model_validate_json((await self.connection.request("POST", "/v1/fine_tuning/jobs", json=body)).content)

    async def get_job(self, job_id: str) -> Job:
        return Job.model_validate_json((await self.connection.request("GET", _job_path(job_id))).content)

    async def list_jobs(self, limit: int, after: str | None) -> list[Job]:
        response = await self.connection.request("GET", "/v1/fine_tuning/jobs", params=_page(limit, after))
        return [Job.model_validate(job) for job in response.json()["data"]]

    async def control_job(self, job_id: str, action: str) -> Job:
        """`cancel`, `pause` or `resume`: asking twice asks for the same, so a broken-off request is retried."""
        response = await self.connection.request("POST", _job_path(job_id, action), idempotent=True)
        return Job.model_validate_json(response.content)

    async def job_events(self, job_id: str, limit: int, after: str | None) -> list[JobEvent]:
        response = await self.connection.request("GET", _job_path(job_id, "events"), params=_page(limit, after))
        return [JobEvent.model_validate(event) for event in response.json()["data"]]

    async def job_checkpoints(self, job_id: str) -> list[Checkpoint]:
        response = await self.connection.request("GET", _job_path(job_id, "checkpoints"), params={"limit": 1000})
        return [Checkpoint.model_validate(checkpoint) for checkpoint in response.json()["data"]]

    def job_log_lines(self, job_id: str, after: str | None, idle_timeout: float) -> AsyncGenerator[str, None]:
        """A job's log, followed live: one JSON event per line after `after`, then the final job object."""
        params = {"follow": "true"} | ({"after": after} if after else {})
        return self.connection.stream_lines("GET", f"/api/training/logs/{job_id}", params=params,
                                            idle_timeout=idle_timeout)


def _model_path(name: str, suffix: str = "") -> str:
    return f"/v1/trainable_models/{name}{suffix}"


def _session_path(session_id: str, action: str = "") -> str:
    return f"/v1/training_sessions/{session_id}" + (f"/{action}" if action else "")


def _job_path(job_id: str, action: str = "") -> str:
    return f"/v1/fine_tuning/jobs/{job_id}" + (f"/{action}" if action else "")


def _page(limit: int, after: str | None) -> dict[str, Any]:
    return {"limit": limit} | ({"after": after} if after else {})
