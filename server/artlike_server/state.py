"""The objects one running server shares between its routes, built once by `app.create_app`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import Request

if TYPE_CHECKING:
    from .completion_log import CompletionLog
    from .engine.pool import EnginePool
    from .jobs.files import FileStore
    from .jobs.graders_service import GraderService
    from .jobs.sandbox import Sandbox
    from .jobs.service import JobService
    from .metrics import Metrics
    from .models.manager import ModelManager
    from .models.registry import ModelRegistry
    from .models.store import ModelStore
    from .openai_api.dialects import Dialect
    from .openai_api.response_store import ResponseStore
    from .openai_api.serving import OpenAIServing
    from .scoring.service import RewardScoring
    from .settings import ServerSettings
    from .studio.continual import ContinualTrainer
    from .studio.ratings import RatingService
    from .studio.reward_training import RatingsRewardTrainer
    from .studio.store import StudioStore
    from .studio.trajectories import TrajectoryBrowser
    from .studio.ui_sessions import UiSessions
    from .tensorboard_log import TensorBoardLog
    from .training.job import TrainingService
    from .training.sessions import TrainingSessions
    from .training.trainer_client import TrainerProcess


@dataclass
class AppState:
    settings: ServerSettings
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
    ui_sessions: UiSessions
    scoring: RewardScoring
    serving: OpenAIServing  # the OpenAI surface: completions forwarded, rewritten and recorded
    tensorboard: TensorBoardLog | None = None
    dialects: dict[str, Dialect] = field(default_factory=dict)  # APIs served by translation, by route name


def get_state(request: Request) -> AppState:
    state: AppState = request.app.state.artlike
    return state
