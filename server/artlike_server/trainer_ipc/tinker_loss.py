"""The config of a pass that trains with one of Tinker's built-in losses (`torch_worker/objectives/tinker.py`).

Server-internal: the Tinker-compatible routes send it to the worker in `protocol.Pass`; it is not one of the
public `artlike.types.TrainConfig` objectives, so `/_train_model` jobs cannot ask for it. The per-token
coefficients travel with the sequences (`TrainSequence.token_advantages`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

TinkerLossFn = Literal["cross_entropy", "importance_sampling", "ppo", "cispo", "dro"]


class TinkerLossConfig(BaseModel):
    """One of Tinker's losses, summed over the tokens of every datum (never averaged).

    `clip_low_threshold`/`clip_high_threshold` bound the importance ratio itself (not 1 ± ε) for "ppo" and
    "cispo"; "dro" needs its `beta`.
    """

    model_config = ConfigDict(extra="forbid")

    objective: Literal["tinker"] = "tinker"
    loss_fn: TinkerLossFn
    clip_low_threshold: float = Field(0.8, ge=0.0)
    clip_high_threshold: float = Field(1.2, ge=0.0)
    beta: float | None = Field(None, ge=0.0, description="dro's weight of the squared log-ratio penalty.")
    # What the worker's pass reads of any config: the token budget of one forward/backward, and whether
    # sequences may share their prompt's decoder pass (the Tinker objective trains every datum whole).
    micro_batch_tokens: int = Field(4096, ge=64, le=1_048_576)
    share_prefixes: bool = False

    @model_validator(mode="after")
    def _consistent(self) -> TinkerLossConfig:
        if self.loss_fn == "dro" and self.beta is None:
            raise ValueError("loss_fn 'dro' needs beta")
        if self.clip_low_threshold > self.clip_high_threshold:
            raise ValueError("clip_low_threshold must not exceed clip_high_threshold")
        return self
