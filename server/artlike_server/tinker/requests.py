"""The JSON bodies the Tinker SDK sends, as this server reads them.

Lenient on purpose (`extra="ignore"`): the SDK adds discriminators (`type`) and fields this server has no
use for (idempotency hints, provenance); refusing them would break clients of newer SDK versions.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class CreateSessionBody(_Body):
    tags: list[str] = Field(default_factory=list)
    user_metadata: dict[str, str] | None = None
    sdk_version: str | None = None


class SessionBody(_Body):
    session_id: str


class LoraConfigBody(_Body):
    rank: int = Field(32, ge=1)
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class CreateModelBody(_Body):
    session_id: str
    model_seq_id: int = Field(ge=0)
    base_model: str
    user_metadata: dict[str, str] | None = None
    lora_config: LoraConfigBody = Field(default_factory=LoraConfigBody)


class ModelBody(_Body):
    model_id: str


class AdamParamsBody(_Body):
    learning_rate: float = Field(1e-4, gt=0.0, le=1.0)
    beta1: float = Field(0.9, ge=0.0, lt=1.0)
    beta2: float = Field(0.95, ge=0.0, lt=1.0)
    eps: float = Field(1e-12, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    grad_clip_norm: float = Field(0.0, ge=0.0)  # 0: no clipping


class OptimStepBody(_Body):
    model_id: str
    seq_id: int
    adam_params: AdamParamsBody = Field(default_factory=AdamParamsBody)


class SaveWeightsBody(_Body):
    model_id: str
    seq_id: int
    path: str | None = None  # the checkpoint's name
    user_metadata: dict[str, str] | None = None
    sampling_session_seq_id: int | None = None  # save_weights_for_sampler without a name: a sampler at once


class LoadWeightsBody(_Body):
    path: str
    optimizer: bool = False
    model_id: str | None = None  # load into an existing run (then seq_id orders it)
    seq_id: int | None = None
    session_id: str | None = None  # or make a new run from the checkpoint
    base_model: str | None = None
    model_seq_id: int | None = None
    user_metadata: dict[str, str] | None = None


class CreateSamplingSessionBody(_Body):
    session_id: str
    sampling_session_seq_id: int = Field(ge=0)
    base_model: str | None = None
    model_path: str | None = None


class SamplingParamsBody(_Body):
    max_tokens: int | None = Field(None, ge=1)
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = Field(1.0, ge=0.0)
    top_k: int = -1
    top_p: float = Field(1.0, gt=0.0, le=1.0)


class ChunkBody(_Body):
    type: Literal["encoded_text", "image", "image_asset_pointer", "dmel"] = "encoded_text"
    tokens: list[int] = Field(default_factory=list)


class ModelInputBody(_Body):
    chunks: list[ChunkBody]


class SampleBody(_Body):
    sampling_session_id: str | None = None
    base_model: str | None = None
    model_path: str | None = None
    seq_id: int | None = None
    num_samples: int = Field(1, ge=1)
    prompt: ModelInputBody
    sampling_params: SamplingParamsBody = Field(default_factory=SamplingParamsBody)
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = Field(0, ge=0)
    topk_sample_logprobs: int = Field(0, ge=0)


class RetrieveFutureBody(_Body):
    request_id: str


class WeightsInfoBody(_Body):
    tinker_path: str
