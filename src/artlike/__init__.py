"""artlike: train the model behind an OpenAI-compatible server with GRPO, on your agents' trajectories.

    import artlike as art

    model = art.TrainableModel("mail-agent", "Qwen/Qwen2.5-7B-Instruct", "http://gpu-box:8000")
    await model.register()

    async def rollout(task) -> art.Trajectory:
        async with model.trajectory() as t:          # any OpenAI client on t.base_url is recorded
            t.reward = score(await my_agent(base_url=t.base_url, model=t.model, task=task), task)
        return t

    groups = await art.gather_trajectory_groups(art.TrajectoryGroup(rollout(task) for _ in range(8)) for task in batch)
    result = await model.train(groups, learning_rate=1e-5)   # or: async for event in model.train(...)

A reward model (`art.TrainableModel(..., kind="reward")`) learns from preference pairs or scored examples
(`model.train_reward_model(...)`) and scores conversations: `await art.score(reward_model, trajectories)`.

Sync twins carry a `_sync` suffix (`model.register_sync()`, `model.train_sync(...)`, ...).
This package is the client: it never imports torch, vLLM or the server.
"""

from ._dpo import preference_pairs
from ._errors import (
    APIConnectionError,
    APIError,
    APITimeoutError,
    ArtlikeError,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    InternalServerError,
    JudgeError,
    NotFoundError,
    PayloadTooLargeError,
    ServiceUnavailableError,
    TrainingError,
)
from ._gather import gather_trajectory_groups
from ._http import RetryPolicy
from ._jobs import Jobs
from ._judge import Judge, judge_group, judge_group_sync, judge_groups, judge_groups_sync
from ._model import TrainableModel
from ._pipeline import PipelineResult, PipelineStep, PipelineTrainer
from ._remedies import (
    CurriculumSampler,
    DynamicSampling,
    EntropyControl,
    PassRateCurriculum,
    RetryFailedGroups,
    Schedule,
    rollout_temperature,
)
from ._score import score, score_sync
from ._session import TrainingSession
from ._sft import best_of_groups
from ._train import NoSignalWarning, TrainResult, TrainStream, UnknownEvent, parse_event
from ._trajectory import Trajectory, TrajectoryGroup, choice_to_message
from ._version import __version__
from .job_types import Checkpoint, Job, JobEvent
from .session_types import AdamParams, OptimStepResult, PassResult, SavedState, SessionInfo, SessionSequence
from .types import (
    STREAM_VERSION,
    CISPOConfig,
    DoneEvent,
    DPOConfig,
    ErrorEvent,
    GRPOConfig,
    GSPOConfig,
    KeepBest,
    LoraConfig,
    ModelInfo,
    PPOConfig,
    RewardHeadConfig,
    RewardModelConfig,
    RewardScore,
    ScoredExample,
    SFTConfig,
    StartEvent,
    StatusEvent,
    StepEvent,
    StepInfo,
    StepRetention,
    TrainConfig,
    TrainEvent,
    TrajectoryRecord,
)

__all__ = [
    "STREAM_VERSION",
    "APIConnectionError",
    "APIError",
    "APITimeoutError",
    "AdamParams",
    "ArtlikeError",
    "AuthenticationError",
    "BadRequestError",
    "CISPOConfig",
    "Checkpoint",
    "ConflictError",
    "CurriculumSampler",
    "DPOConfig",
    "DoneEvent",
    "DynamicSampling",
    "EntropyControl",
    "ErrorEvent",
    "GRPOConfig",
    "GSPOConfig",
    "InternalServerError",
    "Job",
    "JobEvent",
    "Jobs",
    "Judge",
    "JudgeError",
    "KeepBest",
    "LoraConfig",
    "ModelInfo",
    "NoSignalWarning",
    "NotFoundError",
    "OptimStepResult",
    "PPOConfig",
    "PassRateCurriculum",
    "PassResult",
    "PayloadTooLargeError",
    "PipelineResult",
    "PipelineStep",
    "PipelineTrainer",
    "RetryFailedGroups",
    "RetryPolicy",
    "RewardHeadConfig",
    "RewardModelConfig",
    "RewardScore",
    "SFTConfig",
    "SavedState",
    "Schedule",
    "ScoredExample",
    "ServiceUnavailableError",
    "SessionInfo",
    "SessionSequence",
    "StartEvent",
    "StatusEvent",
    "StepEvent",
    "StepInfo",
    "StepRetention",
    "TrainConfig",
    "TrainEvent",
    "TrainResult",
    "TrainStream",
    "TrainableModel",
    "TrainingError",
    "TrainingSession",
    "Trajectory",
    "TrajectoryGroup",
    "TrajectoryRecord",
    "UnknownEvent",
    "__version__",
    "best_of_groups",
    "choice_to_message",
    "gather_trajectory_groups",
    "judge_group",
    "judge_group_sync",
    "judge_groups",
    "judge_groups_sync",
    "parse_event",
    "preference_pairs",
    "rollout_temperature",
    "score",
    "score_sync",
]
