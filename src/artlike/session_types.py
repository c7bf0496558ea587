"""The wire protocol of training sessions: low-level training primitives on one model's adapter.

    POST   /v1/training_sessions                          OpenSessionRequest -> SessionInfo (201)
    GET    /v1/training_sessions/{id}                     -> SessionInfo
    POST   /v1/training_sessions/{id}/forward_backward    ForwardBackwardRequest -> PassResult (gradients add up)
    POST   /v1/training_sessions/{id}/forward             ForwardRequest -> PassResult (no gradient)
    POST   /v1/training_sessions/{id}/optim_step          OptimStepRequest -> OptimStepResult
    POST   /v1/training_sessions/{id}/save_state          SaveStateRequest -> SavedState (a new step)
    POST   /v1/training_sessions/{id}/load_state          LoadStateRequest -> SessionInfo
    DELETE /v1/training_sessions/{id}                     -> SessionInfo (ended; pending gradients dropped)

A session holds the model's adapter, its AdamW state and the gradients accumulated since the last
`optim_step` in the trainer. One session per model at a time, and never beside a `/_train_model` job on it.
Plain data (pydantic only), shared by the client and the server like `artlike.types`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from .types import (
    OBJECTIVES,
    FiniteFloat,
    ModelName,
    TrainConfig,
    TrajectoryId,
    _Strict,
    train_config,
)

LossName = Literal["cross_entropy", "importance_sampling", "ppo", "cispo", "dpo"]
LOSS_OBJECTIVES: dict[str, str] = {
    "cross_entropy": "sft",
    "importance_sampling": "importance_sampling",
    "ppo": "grpo",
    "cispo": "cispo",
    "dpo": "dpo",
}
"""Each built-in loss is the `/_train_model` objective of that name (ppo: GRPO's clipped token-ratio loss)."""
assert set(LOSS_OBJECTIVES.values()) <= set(OBJECTIVES)


class AdamParams(_Strict):
    """AdamW's hyperparameters; `optim_step` may override any of them for one step."""

    learning_rate: float = Field(1e-5, gt=0.0, le=1.0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    max_grad_norm: float | None = Field(1.0, gt=0.0)  # clip before the update (null: no clipping)

    @model_validator(mode="after")
    def _betas_in_range(self) -> AdamParams:
        if not all(0.0 <= beta < 1.0 for beta in self.betas):
            raise ValueError("betas must be in [0, 1)")
        return self


class OpenSessionRequest(_Strict):
    model: ModelName
    from_step: int | None = Field(None, ge=0, description="The step to start from (default: the latest).")
    optimizer: AdamParams = Field(default_factory=AdamParams)
    idle_timeout_s: float = Field(600.0, ge=5.0, le=86_400.0, description="Ended after this long unused.")


class SessionSequence(_Strict):
    """One training sequence, token-level: what the model saw and which tokens the loss scores.

    `trainable[t]`: token t is scored (default: every token after the first); `logprobs[t]`: the sampler's
    logprob of token t (null: unknown, ratio 1); `advantage`: the sequence's (policy-gradient losses);
    `pair` and `preference`: the DPO pair it belongs to and its side."""

    token_ids: list[int] = Field(min_length=2)
    trainable: list[bool] | None = None
    logprobs: list[FiniteFloat | None] | None = None
    advantage: FiniteFloat = 0.0
    pair: int | None = Field(None, ge=0)
    preference: Literal["chosen", "rejected"] | None = None

    @model_validator(mode="after")
    def _aligned(self) -> SessionSequence:
        for name in ("trainable", "logprobs"):
            values = getattr(self, name)
            if values is not None and len(values) != len(self.token_ids):
                raise ValueError(f"`{name}` has {len(values)} entries for {len(self.token_ids)} token_ids")
        if (self.pair is None) != (self.preference is None):
            raise ValueError("`pair` and `preference` go together")
        if self.trainable is not None and not any(self.trainable[1:]):
            raise ValueError("no token after the first is trainable")
        return self


class RecordedSequence(_Strict):
    """A trajectory the server recorded, trained on its exact sampled tokens, with its advantage."""

    trajectory_id: TrajectoryId
    advantage: FiniteFloat = 0.0


class ForwardRequest(_Strict):
    """Sequences to score: token-level `sequences` and/or recorded `trajectories`. With `loss`, the loss and
    its statistics are computed too (`loss_config`: the fields of that objective's config)."""

    sequences: list[SessionSequence] = Field(default_factory=list)
    trajectories: list[RecordedSequence] = Field(default_factory=list)
    loss: LossName = "cross_entropy"
    loss_config: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _has_data(self) -> ForwardRequest:
        if not self.sequences and not self.trajectories:
            raise ValueError("send `sequences` or `trajectories`")
        return self

    def config(self) -> TrainConfig:
        """The objective config of `loss` (raises pydantic's ValidationError for a bad `loss_config`)."""
        return train_config(**{**self.loss_config, "objective": LOSS_OBJECTIVES[self.loss]})


class ForwardBackwardRequest(ForwardRequest):
    """`forward` plus the backward pass: the loss's gradients add to the session's, until `optim_step`.

    Each call's loss is normalised within the call (its tokens, sequences or pairs, as the objective
    says), so two calls accumulate the sum of two such losses' gradients."""


class SequenceResult(BaseModel):
    logprobs: list[float | None]  # aligned to token_ids: the model's logprob of each scored token, else null


class PassResult(BaseModel):
    loss: float
    tokens: int  # scored tokens
    objective: str
    metrics: dict[str, float]  # policy_loss, kl, entropy, clip_fraction, logprob_mismatch + the objective's own
    sequences: list[SequenceResult]  # `sequences` first, then `trajectories`' sequences, in request order
    pending_passes: int  # forward_backward calls whose gradients wait for the next optim_step
    seconds: float


class OptimStepRequest(_Strict):
    """Overrides of the session's optimizer parameters for this step (and the steps after it)."""

    learning_rate: float | None = Field(None, gt=0.0, le=1.0)
    betas: tuple[float, float] | None = None
    eps: float | None = Field(None, gt=0.0)
    weight_decay: float | None = Field(None, ge=0.0)
    max_grad_norm: float | None = Field(None, gt=0.0)


class OptimStepResult(BaseModel):
    grad_norm: float  # before clipping
    optimizer_steps: int  # optimizer steps taken by this training session
    learning_rate: float
    seconds: float


class SaveStateRequest(_Strict):
    serve: bool = True  # load the new step into the engine now (else it loads on its first request)


class SavedState(BaseModel):
    model: str  # "name@N": sample from the saved weights under this name
    step: int
    adapter_path: str
    served: bool
    seconds: float


class LoadStateRequest(_Strict):
    step: int = Field(ge=0)
    optimizer: bool = True
    """Continue with the AdamW state saved beside the step; False starts the optimizer afresh on its weights."""


class SessionInfo(BaseModel):
    id: str
    object: Literal["training_session"] = "training_session"
    model: str
    step: int  # the step its weights started from (the last saved or loaded one)
    created_at: float
    last_used_at: float
    idle_timeout_s: float
    optimizer: AdamParams
    optimizer_steps: int
    pending_passes: int
    status: Literal["open", "ended"] = "open"
