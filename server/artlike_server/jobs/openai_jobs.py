"""OpenAI's fine-tuning jobs API on the job engine: the create request, and the job, event and checkpoint
objects as `openai-openapi.yaml` shapes them.

artlike's extensions ride in `method.reinforcement.hyperparameters` (the SDK's `extra_body` or a plain dict):
`iterations`, `group_size`, `learning_rate` (absolute), `max_tokens`, `temperature`, `max_turns`,
`multi_step`, and against a flattening curve `dynamic_sampling` (true, or `{"min_signal_groups",
"max_resample_factor"}`), `entropy_coef`, `entropy_control` (`{"target", "coef_step", "max_coef"}`: the
entropy bonus moved after each iteration towards a target sampling entropy), `epsilon_high`,
`clip_cov_fraction`, `positive_advantage_weight`, `temperature_schedule`, `group_size_schedule`,
`learning_rate_schedule` (each `{"start", "end", "steps", "shape", "warmup_steps"}` over iterations).
`fine_tuned_model` is the trainable model's name on this server: chat with it, or with a checkpoint's
`name@N`.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field

from artlike import DynamicSampling, EntropyControl, Schedule

from ..errors import InvalidRequest
from ..models.store import ModelStore
from .datasets import DatasetError, parse_chat_examples, parse_preference_rows
from .files import FileStore
from .intake import (
    REMEDY_FIELDS,
    check_episode_functions,
    check_guide_field,
    grader_reward,
    prompt_rows,
    remedy_settings,
    resolve_target,
)
from .service import NewJob
from .spec import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_LEARNING_RATE,
    EvalSettings,
    JobSpec,
    RemedySettings,
    RolloutSettings,
)
from .store import CheckpointRecord, EventRecord, JobRecord

Auto = Literal["auto"]


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class Hyperparameters(_Open):
    n_epochs: int | Auto | None = Field(None)
    batch_size: int | Auto | None = None
    learning_rate_multiplier: float | Auto | None = None
    eval_interval: int | Auto | None = None
    eval_samples: int | Auto | None = None
    compute_multiplier: float | Auto | None = None
    reasoning_effort: str | None = None
    beta: float | Auto | None = None  # dpo
    # artlike
    iterations: int | None = Field(None, ge=1)
    group_size: int | None = Field(None, ge=2, le=64)
    learning_rate: float | None = Field(None, gt=0.0)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    max_turns: int | None = Field(None, ge=1, le=64)
    multi_step: bool | None = None
    dynamic_sampling: bool | DynamicSampling | None = None
    entropy_coef: float | None = None  # these are checked by RemedySettings
    entropy_control: EntropyControl | None = None
    epsilon_high: float | None = None
    clip_cov_fraction: float | None = None
    positive_advantage_weight: float | None = None
    temperature_schedule: Schedule | None = None
    group_size_schedule: Schedule | None = None
    learning_rate_schedule: Schedule | None = None
    guide_field: str | None = None

    def remedies(self) -> RemedySettings:
        return remedy_settings({name: getattr(self, name) for name in REMEDY_FIELDS},
                               param="method.reinforcement.hyperparameters")


class Reinforcement(_Open):
    grader: dict[str, Any]
    hyperparameters: Hyperparameters = Hyperparameters()


class Supervised(_Open):
    hyperparameters: Hyperparameters = Hyperparameters()


class Method(_Open):
    type: Literal["supervised", "dpo", "reinforcement"]
    supervised: Supervised | None = None
    dpo: Supervised | None = None
    reinforcement: Reinforcement | None = None


class CreateJobRequest(_Open):
    model: str
    training_file: str
    validation_file: str | None = None
    suffix: str | None = Field(None, max_length=64)
    seed: int | None = None
    method: Method | None = None
    hyperparameters: Hyperparameters | None = None  # deprecated top-level form (supervised)
    metadata: dict[str, str] | None = None


def _value(value: Any, default: Any) -> Any:
    return default if value is None or value == "auto" else value


def new_job(request: CreateJobRequest, *, files: FileStore, models: ModelStore, served_base: str) -> NewJob:
    method = request.method or Method(type="supervised", supervised=Supervised(
        hyperparameters=request.hyperparameters or Hyperparameters()))
    target = resolve_target(request.model, served_base=served_base, models=models, suffix=request.suffix,
                            param="model")
    training = files.read(request.training_file)  # 404 naming the file when it does not exist
    validation = files.read(request.validation_file) if request.validation_file else None
    seed = request.seed if request.seed is not None else 0
    common = {"api": "openai", "base_model": target.base_model, "target_model": target.target_model,
              "create_target": target.create, "seed": seed}
    if method.type == "reinforcement":
        if method.reinforcement is None:
            raise InvalidRequest("method.reinforcement (with a grader) is required for a reinforcement job",
                                 param="method.reinforcement", code="invalid_value")
        h = method.reinforcement.hyperparameters
        rows = prompt_rows(training, param="training_file")
        validation_rows = prompt_rows(validation, param="validation_file") if validation else []
        reward = grader_reward(method.reinforcement.grader, param="method.reinforcement.grader")
        rollout = RolloutSettings(**{k: v for k, v in {
            "group_size": h.group_size, "max_tokens": h.max_tokens, "temperature": h.temperature,
            "max_turns": h.max_turns, "multi_step": h.multi_step}.items() if v is not None})
        check_episode_functions([*rows, *validation_rows], reward, multi_step=rollout.multi_step,
                                param="method.reinforcement.grader")
        remedies = h.remedies()
        check_guide_field(rows, remedies, param="method.reinforcement.hyperparameters.guide_field")
        batch_size = min(_value(h.batch_size, DEFAULT_BATCH_SIZE), len(rows))
        iterations = h.iterations or math.ceil(len(rows) * _value(h.n_epochs, 1) / batch_size)
        eval_interval = _value(h.eval_interval, None)
        spec = JobSpec(**common, method="reinforcement", reward=reward, iterations=iterations, batch_size=batch_size,
                       learning_rate=h.learning_rate or DEFAULT_LEARNING_RATE * _value(h.learning_rate_multiplier, 1.0),
                       rollout=rollout, remedies=remedies, eval=EvalSettings(interval=eval_interval,
                                                          samples=_value(h.eval_samples, 1)),
                       train_rows=len(rows), validation_rows=len(validation_rows),
                       hyperparameters=h.model_dump(mode="json", exclude_none=True))
        return NewJob(spec, [r.item for r in rows], [r.item for r in validation_rows],
                      training_file=request.training_file, validation_file=request.validation_file,
                      suffix=request.suffix, metadata=request.metadata)
    options = (method.supervised if method.type == "supervised" else method.dpo) or Supervised()
    h = options.hyperparameters
    try:
        data = parse_chat_examples(training) if method.type == "supervised" else parse_preference_rows(training)
    except DatasetError as error:
        raise InvalidRequest(str(error), param="training_file", code="invalid_dataset") from error
    default_lr = 1e-4 if method.type == "supervised" else 5e-6
    spec = JobSpec(**common, method=method.type, iterations=_value(h.n_epochs, 1) if h.iterations is None else h.iterations,
                   batch_size=min(_value(h.batch_size, DEFAULT_BATCH_SIZE), len(data)),
                   learning_rate=h.learning_rate or default_lr * _value(h.learning_rate_multiplier, 1.0),
                   train_rows=len(data), hyperparameters=h.model_dump(exclude_none=True))
    return NewJob(spec, _objects(training), [],
                  training_file=request.training_file, suffix=request.suffix, metadata=request.metadata)


def _objects(content: bytes) -> list[Any]:
    """The rows of a JSONL file already validated by the dataset parser, stored as they were."""
    return [orjson.loads(line) for line in content.splitlines() if line.strip()]


# --------------------------------------------------------------------------------------- responses


def job_object(job: JobRecord) -> dict[str, Any]:
    spec = job.spec
    h = dict(spec.hyperparameters)
    hyperparameters = {"n_epochs": h.get("n_epochs", "auto"), "batch_size": spec.batch_size,
                       "learning_rate_multiplier": h.get("learning_rate_multiplier", "auto")}
    method_hyper = {**h, "batch_size": spec.batch_size, "iterations": spec.iterations,
                    "learning_rate": spec.learning_rate}
    method: dict[str, Any] = {"type": spec.method}
    if spec.method == "reinforcement":
        grader = spec.reward.grader if spec.reward is not None and spec.reward.kind == "grader" else \
            {"type": "python", "name": "reward", "source": spec.reward.source if spec.reward else ""}
        method["reinforcement"] = {"grader": grader, "hyperparameters": method_hyper | {
            "group_size": spec.rollout.group_size, "max_tokens": spec.rollout.max_tokens,
            "temperature": spec.rollout.temperature, "max_turns": spec.rollout.max_turns}}
    else:
        method[spec.method] = {"hyperparameters": method_hyper}
    return {
        "object": "fine_tuning.job", "id": job.id, "created_at": job.created_at, "status": job.status,
        "model": spec.base_model if spec.create_target else spec.target_model,
        "fine_tuned_model": spec.target_model if job.status == "succeeded" else None,
        "finished_at": job.finished_at, "error": job.error, "organization_id": "org-artlike",
        "result_files": [], "trained_tokens": job.trained_tokens if job.finished else None,
        "training_file": job.training_file or "inline", "validation_file": job.validation_file,
        "hyperparameters": hyperparameters, "seed": spec.seed, "estimated_finish": None, "integrations": [],
        "method": method, "metadata": job.metadata, "user_provided_suffix": job.suffix,
        # artlike: where the job is (the API has no progress field), and a cancel or pause that waits for the
        # end of the current step (OpenAI's statuses have no "cancelling": the job is `running` until then)
        "artlike": {"target_model": spec.target_model, "iteration": job.iteration,
                    "total_iterations": spec.iterations, "metrics": job.last_metrics, "api": spec.api,
                    "stop_request": job.stop_request},
    }


def event_object(event: EventRecord) -> dict[str, Any]:
    return {"object": "fine_tuning.job.event", "id": event.id, "created_at": event.created_at,
            "level": event.level, "message": event.message, "type": event.type,
            **({"data": event.data} if event.data is not None else {})}


def checkpoint_object(checkpoint: CheckpointRecord) -> dict[str, Any]:
    return {"object": "fine_tuning.job.checkpoint", "id": checkpoint.id, "created_at": checkpoint.created_at,
            "fine_tuned_model_checkpoint": checkpoint.model_checkpoint, "step_number": checkpoint.step_number,
            "metrics": checkpoint.metrics, "fine_tuning_job_id": checkpoint.job_id}
