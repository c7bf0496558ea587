"""The parts of one running server that its routes share (`Services`), and how a route finds them.

`services.build_services` builds and starts them; `app.create_app` hands them to every route through
`request.app.state.artlike`. Routes read the parts, never the settings: a part carries what it was given.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import Request

if TYPE_CHECKING:
    from .adapter_import.service import ImportService
    from .completion_log import CompletionLog
    from .engine.pool import EnginePool
    from .export.service import ExportService
    from .jobs.files import FileStore
    from .jobs.graders_service import GraderService
    from .jobs.sandbox import Sandbox
    from .jobs.service import JobService
    from .metrics import Metrics
    from .models.manager import ModelManager
    from .models.registry import ModelRegistry
    from .models.store import ModelStore
    from .openai_api.dialects import Dialect
    from .openai_api.policy import RequestPolicy
    from .openai_api.response_store import ResponseStore
    from .openai_api.serving import OpenAIServing
    from .scoring.service import RewardScoring
    from .settings import EngineSettings, NetworkSettings, TrainerSettings
    from .studio.continual import ContinualTrainer
    from .studio.page_logins import PageLogins
    from .studio.ratings import RatingService
    from .studio.reward_training import RatingsRewardTrainer
    from .studio.store import StudioStore
    from .studio.trajectories import TrajectoryBrowser
    from .tinker.service import TinkerService
    from .trackers.base import Trackers
    from .training.job import TrainingService
    from .training.sessions import TrainingSessions
    from .training.trainer_client import TrainerProcess


@dataclass(frozen=True)
class BaseModelInfo:
    """The base model this server serves, as requests name it and as registration checks it."""

    name: str  # its id in the OpenAI API
    path: Path  # its directory (or hub id)
    max_lora_rank: int  # the largest rank the engine was started for


@dataclass
class Services:
    base_model: BaseModelInfo
    network: NetworkSettings  # the key and host names the middleware checks
    max_body_bytes: int  # the largest request body (413 beyond)
    engine_settings: EngineSettings  # what /health reports of the engine (dtype and how it was chosen)
    trainer_settings: TrainerSettings
    requests: RequestPolicy  # what one completion request may ask for
    engine: EnginePool  # every engine (local or remote) behind the proxy; also its routing and admin calls
    store: ModelStore
    models: ModelManager
    registry: ModelRegistry  # what /v1/trainable_models does: registration, aliases, steps
    log: CompletionLog
    metrics: Metrics
    trainer: TrainerProcess
    training: TrainingService
    sessions: TrainingSessions
    response_store: ResponseStore
    sandbox: Sandbox
    files: FileStore
    graders: GraderService
    jobs: JobService
    studio: StudioStore
    ratings: RatingService
    reward_trainer: RatingsRewardTrainer  # reward models from ratings
    continual: ContinualTrainer
    trajectories: TrajectoryBrowser
    page_logins: PageLogins
    scoring: RewardScoring
    exports: ExportService  # trained steps as PEFT, merged or GGUF tars
    imports: ImportService  # PEFT adapters trained elsewhere, as new steps
    serving: OpenAIServing  # the OpenAI surface: completions forwarded, rewritten and recorded
    tinker: TinkerService  # the Tinker API: runs, checkpoints and samplers over the parts above
    trackers: Trackers | None = None  # --tensorboard-dir, --wandb-project, --mlflow-tracking-uri
    dialects: dict[str, Dialect] = field(default_factory=dict)  # APIs served by translation, by route name


def get_state(request: Request) -> Services:
    state: Services = request.app.state.artlike
    return state
