"""MotteRL's training API on the job engine, accepted verbatim.

    POST /api/training/start  {"model", "learningRate", "iterations", "batchSize", "multiStep",
                               "rewardFunction", "trainingData": [{"prompt", "expected_result", ...}]}

MotteRL's model names ("qwen-2.5-7b") name its own cloud's models: a name this server does not serve
trains this server's base model, and the job's events say so. `iterations` may be a string ("100").
Extensions: `groupSize`, `maxTokens`, `temperature`, `maxTurns`, `validationData`, `evalInterval`, `seed`,
and against a flattening curve `dynamicSampling` (true, or `{"min_signal_groups", "max_resample_factor"}`),
`entropyCoef`, `epsilonHigh`, `temperatureSchedule`, `groupSizeSchedule`, `learningRateSchedule` (each
`{"start", "end", "steps", "shape", "warmup_steps"}` over iterations).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from artlike import DynamicSampling, EntropyControl, Schedule

from ..errors import InvalidRequest
from ..http_body import validate
from ..models.store import ModelStore
from .intake import (
    REMEDY_FIELDS,
    check_episode_functions,
    check_guide_field,
    prompt_rows,
    python_reward,
    remedy_settings,
    resolve_target,
)
from .service import NewJob
from .spec import DEFAULT_BATCH_SIZE, DEFAULT_LEARNING_RATE, EvalSettings, JobSpec, RolloutSettings
from .store import JobRecord

STATUS = {"validating_files": "queued", "queued": "queued", "running": "training", "paused": "paused",
          "succeeded": "completed", "failed": "failed", "cancelled": "cancelled"}


class StartTraining(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    model: str
    learning_rate: float = Field(DEFAULT_LEARNING_RATE, alias="learningRate", gt=0.0)
    iterations: int = Field(100, ge=1, le=100_000)
    batch_size: int = Field(DEFAULT_BATCH_SIZE, alias="batchSize", ge=1, le=256)
    multi_step: bool = Field(False, alias="multiStep")
    reward_function: str = Field(alias="rewardFunction", min_length=1)
    training_data: list[dict[str, Any]] = Field(alias="trainingData", min_length=1)
    validation_data: list[dict[str, Any]] | None = Field(None, alias="validationData")
    group_size: int | None = Field(None, alias="groupSize", ge=2, le=64)
    max_tokens: int | None = Field(None, alias="maxTokens", ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    max_turns: int | None = Field(None, alias="maxTurns", ge=1, le=64)
    eval_interval: int | None = Field(None, alias="evalInterval", ge=1)
    seed: int = 0
    dynamic_sampling: bool | DynamicSampling | None = Field(None, alias="dynamicSampling")
    entropy_coef: float | None = Field(None, alias="entropyCoef")
    entropy_control: EntropyControl | None = Field(None, alias="entropyControl")
    epsilon_high: float | None = Field(None, alias="epsilonHigh")
    clip_cov_fraction: float | None = Field(None, alias="clipCovFraction")
    positive_advantage_weight: float | None = Field(None, alias="positiveAdvantageWeight")
    temperature_schedule: Schedule | None = Field(None, alias="temperatureSchedule")
    group_size_schedule: Schedule | None = Field(None, alias="groupSizeSchedule")
    learning_rate_schedule: Schedule | None = Field(None, alias="learningRateSchedule")
    guide_field: str | None = Field(None, alias="guideField")


def parse_start(body: Any) -> StartTraining:
    return validate(body, StartTraining)


def new_job(request: StartTraining, *, models: ModelStore, served_base: str) -> NewJob:
    warnings: list[str] = []
    try:
        target = resolve_target(request.model, served_base=served_base, models=models, suffix="motterl",
                                param="model")
    except InvalidRequest:
        target = resolve_target(served_base, served_base=served_base, models=models, suffix="motterl", param="model")
        warnings.append(f"model {request.model!r} is not served here; the job trains this server's base model "
                        f"{served_base!r}")
    rows = prompt_rows(request.training_data, param="trainingData")
    validation = prompt_rows(request.validation_data, param="validationData") if request.validation_data else []
    reward = python_reward(request.reward_function, param="rewardFunction")
    multi_step = request.multi_step
    max_turns = request.max_turns or (4 if multi_step else 1)
    check_episode_functions([*rows, *validation], reward, multi_step=multi_step, param="rewardFunction")
    rollout = RolloutSettings(**{k: v for k, v in {
        "group_size": request.group_size, "max_tokens": request.max_tokens, "temperature": request.temperature,
        "max_turns": max_turns, "multi_step": multi_step}.items() if v is not None})
    wire_names = {name: StartTraining.model_fields[name].alias or name for name in REMEDY_FIELDS}
    remedies = remedy_settings({name: getattr(request, name) for name in REMEDY_FIELDS}, param=None,
                               wire_names=wire_names)
    check_guide_field(rows, remedies, param="guideField")
    spec = JobSpec(api="motterl", method="reinforcement", base_model=target.base_model,
                   target_model=target.target_model, create_target=target.create, reward=reward,
                   iterations=request.iterations, batch_size=min(request.batch_size, len(rows)),
                   learning_rate=request.learning_rate, seed=request.seed, rollout=rollout, remedies=remedies,
                   eval=EvalSettings(interval=request.eval_interval), train_rows=len(rows),
                   validation_rows=len(validation),
                   hyperparameters={"learningRate": request.learning_rate, "iterations": request.iterations,
                                    "batchSize": request.batch_size, "multiStep": multi_step})
    return NewJob(spec, [r.item for r in rows], [r.item for r in validation], warnings=tuple(warnings))


def status_object(job: JobRecord) -> dict[str, Any]:
    metrics = job.last_metrics
    total = job.spec.iterations
    return {
        "job_id": job.id, "status": STATUS[job.status], "progress": round(job.iteration / total, 4),
        "currentIteration": job.iteration, "totalIterations": total,
        "metrics": {"averageReward": metrics.get("reward_mean"), "loss": metrics.get("loss")},
        "model": job.spec.target_model, "error": job.error["message"] if job.error else None,
        "createdAt": job.created_at, "finishedAt": job.finished_at,
        "stopRequest": job.stop_request,  # "cancel" | "pause" pending the end of the current step, or None
    }

