"""The wire protocol of the studio: ratings, continual training from them, and browsing what was recorded.

    POST  /v1/ratings                                  RatingRequest -> RatingList (201)
    GET   /v1/ratings                                  -> RatingList (or JSONL with format=jsonl)
    GET   /v1/ratings/pairs                            -> {"data": [RatedPair]} (or JSONL)
    POST  /v1/ratings/train_reward_model               RewardModelFromRatings -> the /_train_model NDJSON stream
    GET   /v1/ratings/inbox                            -> {"data": [InboxItem]} (unrated completions)
    GET   /v1/trainable_models/{name}/continual        -> ContinualStatus
    PATCH /v1/trainable_models/{name}/continual        ContinualPolicyUpdate -> ContinualStatus
    GET   /v1/trajectories                             -> {"data": [TrajectoryListItem]}
    GET   /v1/trajectories/{id}/view                   -> TrajectoryView (decoded text, token view)

Rewards from ratings, in [0, 1]: thumb up 1, down 0; scale 1..5 -> (v - 1) / 4; a ranking of n answers
(best first) -> 1 - position / (n - 1); a skip has none. Plain data (pydantic only), shared by the client
and the server like `artlike.types`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .types import ModelName, RewardModelConfig, _Strict

RatingKind = Literal["thumb", "scale", "ranking", "skip"]
Split = Literal["auto", "train", "holdout"]


class _RatingCommon(_Strict):
    comment: str | None = Field(None, max_length=4000)
    rater: str | None = Field(None, min_length=1, max_length=200, description="Default: 'api' (the page: 'studio').")
    split: Split = Field("auto", description="'holdout' keeps the rating out of training (the promotion guard "
                                             "judges steps on held-out ratings); 'auto' follows the policy.")


class ThumbRating(_RatingCommon):
    kind: Literal["thumb"]
    completion_id: int
    value: Literal["up", "down"]


class ScaleRating(_RatingCommon):
    kind: Literal["scale"]
    completion_id: int
    value: int = Field(ge=1, le=5)


class RankingRating(_RatingCommon):
    kind: Literal["ranking"]
    completion_ids: list[int] = Field(min_length=2, max_length=16, description="Best first.")

    @model_validator(mode="after")
    def _distinct(self) -> RankingRating:
        if len(set(self.completion_ids)) != len(self.completion_ids):
            raise ValueError("a ranking names each completion once")
        return self


class SkipRating(_RatingCommon):
    kind: Literal["skip"]
    completion_id: int


RatingRequest = Annotated[ThumbRating | ScaleRating | RankingRating | SkipRating, Field(discriminator="kind")]


class Rating(BaseModel):
    id: int
    completion_id: int
    trajectory_id: str
    model: str  # the trainable model (or the base model id) that served the completion
    step: int | None
    kind: RatingKind
    value: str | int | None  # "up"/"down", 1..5, the rank (0 = best) or None
    reward: float | None  # in [0, 1]; None for a skip
    ranking_id: str | None = None
    comment: str | None = None
    rater: str
    split: Literal["train", "holdout"]
    created_at: float
    trained_in_step: int | None = None  # the continual step that trained on it (None: not yet)


class RatingList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Rating]
    has_more: bool = False
    last_id: int | None = None


class RatedPair(BaseModel):
    """A chosen/rejected pair of one prompt from ratings (TRL's conversational preference format)."""

    prompt: list[dict[str, Any]]
    chosen: list[dict[str, Any]]
    rejected: list[dict[str, Any]]
    chosen_completion_id: int
    rejected_completion_id: int
    margin: float  # reward(chosen) - reward(rejected), > 0


class RewardModelFromRatings(_Strict):
    """`POST /v1/ratings/train_reward_model`: one training step of a reward model on the train-split ratings
    (held-out ones never train), optionally only those of the completions `policy` served.

    `from`: "pairs" — every (better, worse) pair of rated answers of one prompt, as recorded pairs of those
    completions (the Bradley–Terry loss); "scores" — each rated answer with its reward in [0, 1] as the
    regression target (a reward model with one objective); "both" (default)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    model: ModelName = Field(description="The reward model to train (registered with kind 'reward').")
    policy: str | None = Field(None, min_length=1, description="Only ratings of completions this model served "
                                                              "(a trainable model's name or the base model id).")
    source: Literal["pairs", "scores", "both"] = Field("both", alias="from")
    config: RewardModelConfig = Field(default_factory=RewardModelConfig)
    promote: bool = Field(True, description="False: commit the step as name@N without moving the alias.")


class InboxItem(BaseModel):
    completion_id: int
    trajectory_id: str
    model: str
    served_model: str
    step: int | None
    created_at: float
    messages: list[dict[str, Any]]  # the prompt
    response: dict[str, Any]  # {"content": text}
    metadata: dict[str, Any] = Field(default_factory=dict)


class GuardPolicy(_Strict):
    """Promote a background step only when, on held-out ratings, it moves probability toward the better-rated
    answers at least as much as toward the worse ones (less `margin`)."""

    enabled: bool = False
    margin: float = Field(0.0, ge=0.0, description="Allowed loss of the held-out preference shift (nats/token).")
    holdout_fraction: float = Field(0.2, ge=0.0, lt=1.0, description="Share of rated prompts held out ('auto').")


class ContinualPolicy(_Strict):
    enabled: bool = False
    every: int = Field(16, ge=1, le=10_000, description="Train a step once this many new ratings are waiting.")
    objective: Literal["grpo", "dpo"] = "grpo"
    replay: int = Field(16, ge=0, le=10_000, description="Older rated completions mixed into each step.")
    learning_rate: float = Field(5e-5, gt=0, le=1.0)
    epochs: int = Field(1, ge=1, le=20)
    beta: float = Field(0.1, gt=0.0, le=100.0, description="DPO's beta.")
    guard: GuardPolicy = Field(default_factory=GuardPolicy)


class ContinualPolicyUpdate(_Strict):
    enabled: bool | None = None
    every: int | None = Field(None, ge=1, le=10_000)
    objective: Literal["grpo", "dpo"] | None = None
    replay: int | None = Field(None, ge=0, le=10_000)
    learning_rate: float | None = Field(None, gt=0, le=1.0)
    epochs: int | None = Field(None, ge=1, le=20)
    beta: float | None = Field(None, gt=0.0, le=100.0)
    guard: GuardPolicy | None = None


class GuardVerdict(BaseModel):
    candidate_step: int
    live_step: int
    answers: int  # held-out rated answers judged
    shift: float | None  # mean logprob gain per token on better-rated answers minus on worse-rated ones
    promoted: bool
    reason: str


class ContinualRun(BaseModel):
    started_at: float
    finished_at: float | None = None
    ratings: int  # new ratings it trained on
    replayed: int  # older rated completions mixed in
    step: int | None = None  # the step it committed
    promoted: bool | None = None
    reason: str = ""
    guard: GuardVerdict | None = None
    events: list[dict[str, Any]] = Field(default_factory=list)  # the /_train_model NDJSON events


class ContinualStatus(BaseModel):
    model: str
    policy: ContinualPolicy
    state: Literal["off", "waiting", "training", "evaluating"]
    pending_ratings: int  # train-split ratings no step has trained on yet
    trained_ratings: int
    live_step: int | None
    message: str
    last_run: ContinualRun | None = None


class TrajectoryListItem(BaseModel):
    trajectory_id: str
    models: list[str]
    steps: list[int]
    completions: int
    created_at: float
    last_id: int
    reward: float | None = None  # the reward it was trained with (a /_train_model group)
    rating: float | None = None  # the mean reward of its ratings
    metadata: dict[str, Any] = Field(default_factory=dict)


class TokenView(BaseModel):
    text: str
    logprob: float


class CompletionView(BaseModel):
    id: int
    model: str
    served_model: str
    step: int | None
    created_at: float
    finish_reason: str | None
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    response: dict[str, Any]
    tokens: list[TokenView]


class TrajectoryView(BaseModel):
    trajectory_id: str
    reward: float | None = None
    completions: list[CompletionView]
