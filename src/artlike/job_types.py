"""Managed jobs on the wire: OpenAI's fine-tuning job, event and checkpoint objects (extra fields kept, so
a newer server never breaks an older client)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

FINISHED_STATUSES = frozenset({"succeeded", "failed", "cancelled"})


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class JobError(_Open):
    code: str
    message: str
    param: str | None = None


class Job(_Open):
    id: str
    object: str = "fine_tuning.job"
    created_at: int
    status: str  # validating_files | queued | running | paused | succeeded | failed | cancelled
    model: str
    fine_tuned_model: str | None = None  # the model name to chat with once the job succeeded
    finished_at: int | None = None
    error: JobError | None = None
    training_file: str | None = None
    validation_file: str | None = None
    hyperparameters: dict[str, Any] = Field(default_factory=dict)
    method: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    seed: int | None = None
    trained_tokens: int | None = None
    artlike: dict[str, Any] = Field(default_factory=dict)  # target_model, iteration, total_iterations, metrics,
    # stop_request ("cancel" | "pause" waiting for the end of the current step)

    @property
    def done(self) -> bool:
        return self.status in FINISHED_STATUSES


class JobEvent(_Open):
    id: str
    created_at: int
    level: str
    message: str
    type: str = "message"  # "metrics" events carry data: iteration, reward_mean, loss, ...
    data: dict[str, Any] | None = None


class Checkpoint(_Open):
    id: str
    created_at: int
    fine_tuned_model_checkpoint: str  # "name@N": chat with this step
    step_number: int
    metrics: dict[str, float] = Field(default_factory=dict)
    fine_tuning_job_id: str
