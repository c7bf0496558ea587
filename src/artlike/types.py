"""The wire protocol between the artlike client and server: requests, responses and NDJSON stream events.

Both sides import these pydantic models, so a field is defined once. Everything here is plain data
(pydantic only): the client library must import without torch or vLLM.

HTTP surface (server):
    POST   /v1/trainable_models                      RegisterModelRequest -> ModelInfo (201 new, 200 same)
    GET    /v1/trainable_models                      -> {"data": [ModelInfo]}
    GET    /v1/trainable_models/{name}               -> ModelInfo
    GET    /v1/trainable_models/{name}/steps         -> {"data": [StepInfo]}
    DELETE /v1/trainable_models/{name}/steps?keep=K  -> {"deleted": [int], "data": [StepInfo]}
    GET    /v1/trajectories/{trajectory_id}          -> TrajectoryRecord
    POST   /_train_model                             TrainRequest -> NDJSON stream of TrainEvent
    /v1/... and /t/{trajectory_id}/v1/...            the OpenAI surface (chat/completions, completions, models)
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationInfo,
    field_validator,
    model_validator,
)

STREAM_VERSION = 1
"""Version of the `/_train_model` NDJSON stream; sent in the `start` line and the X-Artlike-Stream-Version header."""

MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
"""Trainable model names: safe as a directory name, no '@' (reserved for `name@step`) and no '/'."""
TRAJECTORY_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$"
_MODEL_NAME_RE = re.compile(MODEL_NAME_PATTERN)
_TRAJECTORY_ID_RE = re.compile(TRAJECTORY_ID_PATTERN)

ModelName = Annotated[str, Field(pattern=MODEL_NAME_PATTERN)]
TrajectoryId = Annotated[str, Field(pattern=TRAJECTORY_ID_PATTERN)]
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
"""A reward or metric: NaN and ±inf (which Python's JSON reader accepts) would poison a whole batch."""

DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def is_valid_model_name(name: str) -> bool:
    return _MODEL_NAME_RE.fullmatch(name) is not None


def is_valid_trajectory_id(trajectory_id: str) -> bool:
    return _TRAJECTORY_ID_RE.fullmatch(trajectory_id) is not None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------------------------------------- models


class LoraConfig(_Strict):
    rank: int = Field(8, ge=1, le=256)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = Field(default_factory=lambda: list(DEFAULT_LORA_TARGETS), min_length=1)


class KeepBest(_Strict):
    """Keep the `count` steps with the best value of a history metric (a dotted path into a history line)."""

    metric: str = Field("reward.mean", min_length=1, description='e.g. "reward.mean", "metrics.accuracy"')
    mode: Literal["max", "min"] = "max"
    count: int = Field(1, ge=1)


class StepRetention(_Strict):
    """Which trained steps a model keeps on disk. After each committed step, every step that no rule keeps is
    deleted; the latest step, step 0 and steps that requests are using are always kept. None: keep all."""

    keep_last: int | None = Field(None, ge=1, description="the newest N steps")
    keep_best: KeepBest | None = None


class RewardHeadConfig(_Strict):
    """The scalar head(s) of a reward model: a linear layer (no bias) on the decoder's last hidden state,
    pooled at the last token (`"last"`, as Hugging Face's `*ForSequenceClassification`) or averaged over the
    tokens (`"mean"`). `num_objectives` > 1: one head per objective, combined as Σ wₖ·sₖ with
    `objective_weights` (AITraining's `MultiObjectiveRewardModel`; default: equal weights summing to 1)."""

    pooling: Literal["last", "mean"] = "last"
    num_objectives: int = Field(1, ge=1, le=32)
    objective_names: list[str] | None = Field(None, description="One per objective (default o0, o1, ...).")
    objective_weights: list[FiniteFloat] | None = None

    @model_validator(mode="after")
    def _one_per_objective(self) -> RewardHeadConfig:
        for field in ("objective_names", "objective_weights"):
            values = getattr(self, field)
            if values is not None and len(values) != self.num_objectives:
                raise ValueError(f"{field} has {len(values)} entries for {self.num_objectives} objective(s)")
        if self.objective_names is not None and len(set(self.objective_names)) != len(self.objective_names):
            raise ValueError("objective_names must be distinct")
        return self

    @property
    def names(self) -> list[str]:
        return list(self.objective_names or [f"o{k}" for k in range(self.num_objectives)])

    @property
    def weights(self) -> list[float]:
        return list(self.objective_weights or [1.0 / self.num_objectives] * self.num_objectives)


ModelKind = Literal["policy", "reward"]


class RegisterModelRequest(_Strict):
    name: ModelName
    base_model: str = Field(min_length=1, description="Must be the base model the server serves.")
    lora: LoraConfig = Field(default_factory=LoraConfig)
    retention: StepRetention | None = Field(
        None, description="Step retention; None keeps the model's current policy (keep all for a new model).")
    kind: ModelKind = Field("policy", description="'policy': served for chat by the engine; 'reward': a "
                            "scorer (base + LoRA + scalar head) served by POST /v1/rewards.")
    reward_head: RewardHeadConfig | None = Field(None, description="kind 'reward' only (default: one objective, "
                                                 "last-token pooling).")

    @model_validator(mode="after")
    def _head_for_reward_models(self) -> RegisterModelRequest:
        if self.kind == "reward" and self.reward_head is None:
            self.reward_head = RewardHeadConfig()
        if self.kind != "reward" and self.reward_head is not None:
            raise ValueError("reward_head is for kind 'reward'")
        return self


class UpdateModelRequest(_Strict):
    """`PATCH /v1/trainable_models/{name}`: what may change after registration."""

    retention: StepRetention


class SetAliasRequest(_Strict):
    """`POST /v1/trainable_models/{name}/alias`: serve this kept step under the alias `name`."""

    step: int = Field(ge=0)
    reason: str | None = Field(None, max_length=500, description="Recorded in the history line.")


class EvaluationRequest(_Strict):
    """`POST /v1/trainable_models/{name}/evaluations`: record how a committed step scored on held-out data.

    Appended to the history as `{"event": "eval", "step", "split", "eval": {metrics}}`; a `keep_best` rule on
    `"eval.<metric>"` then keeps the best evaluated steps (the pipeline trainer's checkpoint retention)."""

    step: int = Field(ge=0)
    metrics: dict[Annotated[str, Field(min_length=1, max_length=100)], FiniteFloat] = Field(min_length=1,
                                                                                              max_length=256)
    split: str = Field("validation", min_length=1, max_length=100)


class StepInfo(BaseModel):
    step: int
    served_name: str  # "name@N": the exact vLLM model name of this step
    created_at: float
    loaded: bool  # currently loaded in the engine (older steps load on demand)
    promoted: bool = True  # False: trained but never served under the alias (a promotion guard held it back)


class ModelInfo(BaseModel):
    name: str
    base_model: str
    lora: LoraConfig
    latest_step: int  # the step the alias `name` serves (moved by training, rollback and promotion)
    newest_step: int | None = None  # the newest committed step (above latest_step after a rollback)
    served_name: str  # "name@latest"
    created_at: float
    steps: list[StepInfo] = Field(default_factory=list)
    retention: StepRetention = Field(default_factory=lambda: StepRetention())
    kind: ModelKind = "policy"
    reward_head: RewardHeadConfig | None = None  # kind 'reward'


# ------------------------------------------------------------------------------------- completion log


class CompletionRecord(BaseModel):
    """One completion (one choice) recorded through a trajectory URL, token-exact."""

    id: int
    trajectory_id: str
    request_id: str  # the OpenAI response id; n>1 gives several records with one request_id
    choice_index: int
    endpoint: Literal["chat.completions", "completions", "responses", "messages"]  # the route it came through
    model: str  # the name the caller asked for
    served_model: str  # the exact engine name that served it ("name@N" or the base model)
    step: int | None  # adapter step served; None for the base model
    request: dict[str, Any]  # the caller's request body, as sent
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    logprobs: list[float]  # sampling logprob of each output token, same length as output_token_ids
    finish_reason: str | None
    created_at: float
    latency_seconds: float


class TrajectoryRecord(BaseModel):
    trajectory_id: str
    completions: list[CompletionRecord]


# ------------------------------------------------------------------------------------------- training


class _TrainOptions(_Strict):
    """Options every objective shares: the optimizer, the schedule over the batch, how it is cut."""

    learning_rate: float = Field(1e-5, gt=0, le=1.0)
    epochs: int = Field(1, ge=1, le=100)
    gradient_steps_per_epoch: int = Field(1, ge=1, le=1024, description="Optimizer steps per pass over the batch.")
    micro_batch_tokens: int = Field(4096, ge=64, le=1_048_576, description="Token budget of one forward/backward.")
    max_grad_norm: float | None = Field(1.0, gt=0)
    weight_decay: float = Field(0.0, ge=0.0)
    # Trajectories of a group share their prompt: the trainer runs it once per micro-batch and lets every
    # sample attend to its keys and values. Same result up to float rounding; off: each sequence whole.
    share_prefixes: bool = True
    # The learning rate over the job's optimizer steps: linear warmup over `warmup_steps`, then constant or
    # a cosine decay to 0 at the last step.
    lr_schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)


class _PolicyGradientOptions(_TrainOptions):
    """Options of the objectives that train on rewarded groups (group-relative advantages)."""

    kl_beta: float = Field(0.0, ge=0.0, description="Weight of the k3 KL penalty to the base model.")
    scale_rewards: bool = True  # False: advantages not divided by the group std (Dr. GRPO)
    positive_advantage_weight: float = Field(1.0, ge=0.0, le=10.0, description="The positive advantages are "
                                             "multiplied by this (W-REINFORCE: 0.1), against a policy collapsing "
                                             "onto one answer per prompt: below 1 a step learns more from the "
                                             "samples that failed than from those that passed. 1: off.")
    mask_truncated: bool = False  # drop completions that hit max_tokens (finish_reason "length")
    pass_threshold: FiniteFloat = Field(0.5, description="A trajectory whose reward is at least this passes: the "
                                  "start event counts groups all-wrong, mixed and all-right by it.")
    measure_kl_to_base: bool = Field(False, description="Report each step's KL to the base model "
                                     "(`kl_to_base`) even when kl_beta is 0, at the cost of one forward pass "
                                     "without gradient over the batch; with kl_beta > 0 it is always reported.")


class _TokenLevelOptions(_PolicyGradientOptions):
    # "token": every trainable token of the step weighs the same; "sequence": every sequence does;
    # "constant": Σ token losses / (sequences × loss_normalizer), Dr. GRPO's length-unbiased normaliser.
    loss_aggregation: Literal["token", "sequence", "constant"] = "token"
    loss_normalizer: int | None = Field(None, ge=1, description="The constant of loss_aggregation 'constant' "
                                        "(e.g. the rollouts' max_tokens).")
    entropy_coef: float = Field(0.0, ge=0.0, description="Entropy bonus: the loss minus entropy_coef × the "
                                "sampled tokens' mean entropy (aggregated as the loss), against a policy "
                                "collapsing onto one answer per prompt. 0: off.")

    @model_validator(mode="after")
    def _constant_needs_its_normalizer(self) -> _TokenLevelOptions:
        if self.loss_aggregation == "constant" and self.loss_normalizer is None:
            raise ValueError("loss_aggregation 'constant' needs loss_normalizer (e.g. the rollouts' max_tokens)")
        return self


class GRPOConfig(_TokenLevelOptions):
    """GRPO: the PPO-clipped importance-weighted loss on group-relative advantages (the default).

    Dr. GRPO is `scale_rewards=False, loss_aggregation="constant", loss_normalizer=<max tokens>`.
    """

    objective: Literal["grpo"] = "grpo"
    epsilon_low: float = Field(0.2, ge=0.0, le=1.0)
    epsilon_high: float = Field(0.28, ge=0.0, le=10.0)
    clip_cov_fraction: float = Field(0.0, ge=0.0, le=1.0, description="Clip-Cov, against entropy collapse: the "
                                     "share of a batch's trained tokens, chosen at random among those whose "
                                     "covariance of logprob and advantage lies in clip_cov_range, that are left "
                                     "out of the loss. 0: off.")
    clip_cov_range: tuple[FiniteFloat, FiniteFloat] = Field((1.0, 5.0), description="The covariance bounds "
                                                            "(low, high) of Clip-Cov's candidate tokens.")

    @model_validator(mode="after")
    def _clip_cov_range_is_ordered(self) -> GRPOConfig:
        low, high = self.clip_cov_range
        if not low < high:
            raise ValueError(f"clip_cov_range must be (low, high) with low < high, got {self.clip_cov_range}")
        return self


class CISPOConfig(_TokenLevelOptions):
    """CISPO (MiniMax-M1): REINFORCE with the importance weight clipped and detached; no token loses its gradient."""

    objective: Literal["cispo"] = "cispo"
    epsilon_low: float = Field(1.0, ge=0.0, le=1.0, description="1.0: no lower bound on the weight (the paper's).")
    epsilon_high: float = Field(0.28, ge=0.0, le=10.0)


class ImportanceSamplingConfig(_TokenLevelOptions):
    """Importance-sampled REINFORCE: −ρ·A per token with the ratio ρ unclipped (GRPO without its trust region)."""

    objective: Literal["importance_sampling"] = "importance_sampling"


class GSPOConfig(_PolicyGradientOptions):
    """GSPO (Qwen): the PPO clip on the sequence-level importance ratio (the geometric mean of token ratios)."""

    objective: Literal["gspo"] = "gspo"
    epsilon_low: float = Field(3e-4, ge=0.0, le=1.0)
    epsilon_high: float = Field(4e-4, ge=0.0, le=10.0)


class SFTConfig(_TrainOptions):
    """Supervised fine-tuning: maximise the likelihood of the examples' assistant tokens (cross-entropy)."""

    objective: Literal["sft"] = "sft"
    assistant_turns: Literal["all", "last"] = "all"  # "last": earlier assistant turns are context only
    lr_schedule: Literal["constant", "cosine"] = "cosine"
    learning_rate: float = Field(1e-4, gt=0, le=1.0)


STEP_REFERENCE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}@[0-9]{1,9}$"
"""A model's step as `name@N` (its served name)."""
MODEL_REFERENCE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}(@[0-9]{1,9})?$"
"""A model (`name`: the step its alias serves) or one of its steps (`name@N`)."""


class DPOConfig(_TrainOptions):
    """DPO: raise the policy's log-likelihood ratio of chosen over rejected answers against a frozen reference.

    `loss_type`: "sigmoid" (the DPO paper; `label_smoothing` > 0 is conservative DPO), "robust" (noise-robust
    DPO: unbiased under `label_smoothing` flipped labels), "hinge" (SLiC), "ipo" (IPO, on mean token
    logprobs). `reference`: the base model (adapter off) by default, or a step `"name@N"` of a model on the
    same base; `reference_free`: no reference (the implicit reward is the policy's logprob alone).
    """

    objective: Literal["dpo"] = "dpo"
    beta: float = Field(0.1, gt=0.0, le=100.0)
    loss_type: Literal["sigmoid", "ipo", "hinge", "robust"] = "sigmoid"
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5, description="The assumed fraction of flipped labels.")
    reference_free: bool = False
    reference: str | None = Field(None, pattern=STEP_REFERENCE_PATTERN)

    @model_validator(mode="after")
    def _consistent(self) -> DPOConfig:
        if self.reference_free and self.reference is not None:
            raise ValueError("reference_free trains without a reference; do not also name one")
        if self.label_smoothing and self.loss_type not in ("sigmoid", "robust"):
            raise ValueError(f"label_smoothing applies to loss_type 'sigmoid' and 'robust', not {self.loss_type!r}")
        return self


class RewardModelConfig(_TrainOptions):
    """Train a reward model (a model registered with kind 'reward'): preference `pairs` with the
    Bradley–Terry loss −log σ(s_c − s_r − margin) (`label_smoothing` ε mixes in the flipped pair), and/or
    `scored` examples with per-objective regression targets (masked MSE on the objectives each row has)."""

    objective: Literal["reward_model"] = "reward_model"
    learning_rate: float = Field(1e-4, gt=0, le=1.0)
    margin: float = Field(0.0, ge=0.0, description="Required score gap of chosen over rejected (Llama 2's margin).")
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5)
    regression_weight: float = Field(1.0, ge=0.0, description="Weight of the regression loss next to the pairs'.")
    center_rewards_coefficient: float | None = Field(
        None, ge=0.0, description="TRL's: penalise (s_c + s_r)² to keep scores centred on 0.")


class PPOConfig(_TrainOptions):
    """PPO with a value head, GAE and an adaptive KL penalty against the reference (the base model).

    Each sequence's reward (the trajectory's, plus the `reward_model`'s score when one is named) lands on
    its last sampled token; every sampled token also gets −β·(logπ_old − logπ_ref); GAE(`gamma`, `lam`) on
    the value head's estimates gives per-token advantages (whitened over the batch) and returns; the policy
    loss is PPO's clip (`clip_ratio`) on the ratio to the recorded behaviour logprobs, the value loss is
    clipped around the old values (`value_clip`), minus `entropy_coef`·entropy. β starts at
    `kl_penalty_coef` and follows AITraining's adaptive controller toward `kl_target` over `kl_horizon`
    sequences; it is carried from step to step with the model (`adaptive_kl: false` keeps it fixed).
    `ppo_epochs` is accepted for `epochs`.
    """

    objective: Literal["ppo"] = "ppo"
    epochs: int = Field(4, ge=1, le=100, validation_alias=AliasChoices("epochs", "ppo_epochs"))
    gradient_steps_per_epoch: int = Field(2, ge=1, le=1024, description="Minibatches per epoch.")
    learning_rate: float = Field(1e-5, gt=0, le=1.0)
    reward_model: str | None = Field(None, pattern=MODEL_REFERENCE_PATTERN,
                                     description="A reward model (`name` or `name@N`) that scores each sequence.")
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    lam: float = Field(0.95, ge=0.0, le=1.0)
    clip_ratio: float = Field(0.2, gt=0.0, le=10.0)
    value_clip: float | None = Field(0.2, gt=0.0, description="None: unclipped value loss.")
    value_coef: float = Field(0.1, ge=0.0)
    entropy_coef: float = Field(0.0, ge=0.0)
    kl_penalty_coef: float = Field(0.05, ge=0.0, description="β of a model's first PPO step.")
    kl_target: float = Field(0.01, gt=0.0, description="Target mean per-token KL(π_old ‖ π_ref).")
    kl_horizon: float = Field(10_000, gt=0.0)
    adaptive_kl: bool = True
    whiten_advantages: bool = True
    mask_truncated: bool = False
    pass_threshold: FiniteFloat = Field(0.5, description="A trajectory whose reward is at least this passes: the "
                                  "start event counts groups all-wrong, mixed and all-right by it (groups whose "
                                  "rewards the reward model gives are not counted).")


def _objective_of(value: Any) -> str:
    # A config without "objective" is GRPO, as before objectives existed.
    if isinstance(value, dict):
        return str(value.get("objective", "grpo"))
    return str(getattr(value, "objective", "grpo"))


# The objectives trained on rewarded groups: they take pass_threshold and report the groups' diagnostics.
GroupObjectiveConfig = GRPOConfig | CISPOConfig | GSPOConfig | ImportanceSamplingConfig

TrainConfig = Annotated[
    Annotated[GRPOConfig, Tag("grpo")]
    | Annotated[CISPOConfig, Tag("cispo")]
    | Annotated[GSPOConfig, Tag("gspo")]
    | Annotated[ImportanceSamplingConfig, Tag("importance_sampling")]
    | Annotated[SFTConfig, Tag("sft")]
    | Annotated[DPOConfig, Tag("dpo")]
    | Annotated[RewardModelConfig, Tag("reward_model")]
    | Annotated[PPOConfig, Tag("ppo")],
    Discriminator(_objective_of),
]
"""A training job's options: one config class per objective, chosen by its `objective` field (default "grpo")."""

TRAIN_CONFIG: TypeAdapter[TrainConfig] = TypeAdapter(TrainConfig)
OBJECTIVES = ("grpo", "cispo", "gspo", "importance_sampling", "sft", "dpo", "reward_model", "ppo")
"""The `objective` names a `TrainConfig` may carry."""


def train_config(**options: Any) -> TrainConfig:
    """The config of `options["objective"]` (default "grpo") from keyword options; raises ValidationError.

    >>> train_config(objective="cispo", learning_rate=1e-4).epsilon_high
    0.28
    """
    return TRAIN_CONFIG.validate_python(options)


class TrajectoryRef(_Strict):
    """A trajectory recorded by the server (its completions went through /t/{trajectory_id}/v1)."""

    trajectory_id: TrajectoryId
    reward: FiniteFloat | None = Field(None, description="Required, except by PPO with a `reward_model` (which "
                                       "adds it to the model's score when given).")
    metrics: dict[str, FiniteFloat] = Field(default_factory=dict)
    completion_ids: list[int] | None = Field(
        None, min_length=1,
        description="Train only these recorded completions of the trajectory (e.g. the ones a person rated); "
                    "earlier completions stay as context, later ones are left out. Default: all of them.")


class OfflineTrajectory(_Strict):
    """A trajectory the server never saw: chat messages whose assistant turns are trained.

    Assistant messages may carry `token_ids` (the sampled ids) and `logprobs` (their behaviour logprobs);
    without token ids the server tokenizes the content, without logprobs the ratio starts at 1 (on-policy).
    """

    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    reward: FiniteFloat | None = Field(None, description="As TrajectoryRef.reward.")
    metrics: dict[str, FiniteFloat] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _has_assistant_turn(self) -> OfflineTrajectory:
        if not any(m.get("role") == "assistant" for m in self.messages):
            raise ValueError("an offline trajectory needs at least one assistant message to train on")
        return self


class TrainGroup(_Strict):
    trajectories: list[TrajectoryRef | OfflineTrajectory] = Field(min_length=1)


class RecordedExample(_Strict):
    """A supervised example the server recorded: its completions' exact sampled tokens are the targets."""

    trajectory_id: TrajectoryId


class MessagesExample(_Strict):
    """A supervised example as chat messages: the assistant turns, rendered by the model's chat template."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _has_assistant_turn(self) -> MessagesExample:
        if not any(m.get("role") == "assistant" for m in self.messages):
            raise ValueError("an example needs at least one assistant message to train on")
        return self


Messages = list[dict[str, Any]]


def _as_messages(value: Any) -> Any:
    # An answer may be given as its text: one assistant message.
    return [{"role": "assistant", "content": value}] if isinstance(value, str) else value


class RecordedPair(_Strict):
    """A preference between two recorded trajectories of the same prompt: their exact sampled tokens."""

    chosen_trajectory_id: TrajectoryId
    rejected_trajectory_id: TrajectoryId
    # One recorded completion of each trajectory as the answer (its earlier turns are context); default: all.
    chosen_completion_id: int | None = None
    rejected_completion_id: int | None = None

    @model_validator(mode="after")
    def _different(self) -> RecordedPair:
        if (self.chosen_trajectory_id, self.chosen_completion_id) == (self.rejected_trajectory_id,
                                                                      self.rejected_completion_id):
            raise ValueError("the chosen and rejected trajectories are the same")
        return self


class MessagesPair(_Strict):
    """A preference as chat messages (TRL's conversational format): the `prompt` messages, then the `chosen`
    and the `rejected` continuation (assistant turns, with tool calls and results in between when any; a
    string is one assistant message). Only the continuations' assistant tokens are scored."""

    prompt: Messages = Field(min_length=1)
    chosen: Annotated[Messages, BeforeValidator(_as_messages)] = Field(min_length=1)
    rejected: Annotated[Messages, BeforeValidator(_as_messages)] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _usable(self) -> MessagesPair:
        for side in ("chosen", "rejected"):
            if not any(m.get("role") == "assistant" for m in getattr(self, side)):
                raise ValueError(f"`{side}` has no assistant message to score")
        if self.chosen == self.rejected:
            raise ValueError("the chosen and rejected answers are the same")
        return self


def _pair_kind(value: Any) -> str:
    recorded = isinstance(value, RecordedPair) or (isinstance(value, dict) and "chosen_trajectory_id" in value)
    return "recorded" if recorded else "messages"


PreferencePair = Annotated[
    Annotated[RecordedPair, Tag("recorded")] | Annotated[MessagesPair, Tag("messages")],
    Discriminator(_pair_kind),
]
"""A DPO pair: recorded (`chosen_trajectory_id`, `rejected_trajectory_id`) or as messages (`prompt`, ...)."""
PAIR_KINDS = ("recorded", "messages")

class ScoredExample(_Strict):
    """A reward model's regression example: a conversation (chat `messages`, or a recorded trajectory's, up to
    `completion_id` when given) and its target score per objective; null leaves that objective out of this
    row's loss (the objective mask). Ratings 1..5 are usually normalised to [0, 1] first."""

    trajectory_id: TrajectoryId | None = None
    completion_id: int | None = None
    messages: Messages | None = Field(None, min_length=1)
    tools: list[dict[str, Any]] | None = None
    targets: list[FiniteFloat | None] = Field(min_length=1, description="One per objective; null: unknown.")

    @model_validator(mode="after")
    def _one_source(self) -> ScoredExample:
        if (self.trajectory_id is None) == (self.messages is None):
            raise ValueError("give either `messages` or a recorded `trajectory_id`")
        if self.completion_id is not None and self.trajectory_id is None:
            raise ValueError("`completion_id` selects a completion of `trajectory_id`")
        if all(t is None for t in self.targets):
            raise ValueError("every target is null: nothing to learn from this example")
        return self


_DATA_FIELDS: dict[str, tuple[str, ...]] = {"sft": ("examples",), "dpo": ("pairs",),
                                            "reward_model": ("pairs", "scored")}
_DATA_DESCRIPTIONS = {
    "groups": "rewarded `groups`",
    "examples": "`examples` (recorded trajectory ids or chat messages)",
    "pairs": "preference `pairs` (chosen and rejected answers)",
    "scored": "`scored` examples (conversations with target scores)",
}


class TrainRequest(_Strict):
    """`POST /_train_model`: rewarded `groups` for the policy-gradient objectives and PPO, `examples` for SFT,
    preference `pairs` for DPO, `pairs` and/or `scored` examples for a reward model."""

    model: ModelName
    config: TrainConfig = Field(default_factory=GRPOConfig)  # before the data: their checks read it
    groups: list[TrainGroup] = Field(default_factory=list, validate_default=True)
    examples: list[RecordedExample | MessagesExample] = Field(default_factory=list, validate_default=True)
    pairs: list[PreferencePair] = Field(default_factory=list, validate_default=True)
    scored: list[ScoredExample] = Field(default_factory=list, validate_default=True)
    promote: bool = Field(True, description="False: commit the new step as name@N without moving the alias "
                                            "`name` to it (promote it later with POST .../alias)")
    annotations: dict[str, str | int | float | bool] = Field(
        default_factory=dict, description="Recorded as is in the step's history line (e.g. its source).")

    @field_validator("groups", "examples", "pairs", "scored")
    @classmethod
    def _data_fits_the_objective(cls, value: list[Any], info: ValidationInfo) -> list[Any]:
        config = info.data.get("config")
        if config is None:
            return value  # the config itself was invalid: that error is reported
        wanted = _DATA_FIELDS.get(config.objective, ("groups",))
        described = " and/or ".join(_DATA_DESCRIPTIONS[w] for w in wanted)
        if info.field_name == wanted[-1] and not value and not any(info.data.get(w) for w in wanted[:-1]):
            raise ValueError(f"objective {config.objective!r} trains on {described}; send at least one")
        if info.field_name not in wanted and value:
            raise ValueError(f"`{info.field_name}` are not for objective {config.objective!r}, which trains on "
                             f"{described}")
        return value


# ------------------------------------------------------------------------------------------ scoring


class RecordedInput(_Strict):
    """A recorded conversation to score: a trajectory (all its turns) or one completion (with its prompt)."""

    trajectory_id: TrajectoryId | None = None
    completion_id: int | None = None

    @model_validator(mode="after")
    def _something(self) -> RecordedInput:
        if self.trajectory_id is None and self.completion_id is None:
            raise ValueError("give a `trajectory_id`, a `completion_id`, or both")
        return self


class MessagesInput(_Strict):
    """A conversation to score, as chat messages (rendered with the served chat template)."""

    messages: Messages = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None


def _input_kind(value: Any) -> str:
    if isinstance(value, list):
        return "list"
    recorded = isinstance(value, RecordedInput) or (isinstance(value, dict) and "messages" not in value)
    return "recorded" if recorded else "messages"


RewardInput = Annotated[
    Annotated[RecordedInput, Tag("recorded")] | Annotated[MessagesInput, Tag("messages")]
    | Annotated[Messages, Tag("list")],
    Discriminator(_input_kind),
]
"""What `/v1/rewards` scores: a message list, `{"messages", "tools"}`, or `{"trajectory_id"|"completion_id"}`."""


class RewardsRequest(_Strict):
    """`POST /v1/rewards`: score conversations with a reward model."""

    model: str = Field(pattern=MODEL_REFERENCE_PATTERN, description="A reward model `name` or `name@N`.")
    inputs: list[RewardInput] = Field(min_length=1, max_length=1024)


class RewardScore(BaseModel):
    index: int
    score: float  # the combined score Σ wₖ·sₖ (the only score of a single-objective model)
    objectives: dict[str, float]  # per objective, by name
    tokens: int


class RewardsResponse(BaseModel):
    object: Literal["list"] = "list"
    model: str  # "name@N": the step that scored
    data: list[RewardScore]


# ------------------------------------------------------------------------------------- stream events


class StartEvent(BaseModel):
    type: Literal["start"] = "start"
    version: int = STREAM_VERSION
    model: str
    from_step: int
    num_gradient_steps: int
    trajectories: int
    groups: int
    groups_skipped: int  # groups whose rewards were all equal: zero advantage, no signal
    sequences: int
    trainable_tokens: int
    reward_mean: float | None = None  # None: an SFT job (examples have no reward)
    reward_std: float | None = None
    # Rewarded groups (None for other jobs): the fraction whose rewards were all equal, and the per-prompt
    # pass distribution by the config's pass_threshold (groups with a reward model's scores not counted).
    zero_variance_fraction: float | None = None
    groups_all_wrong: int | None = None
    groups_mixed: int | None = None
    groups_all_right: int | None = None
    pass_rate: float | None = None  # fraction of trajectories whose reward reached pass_threshold
    # Recorded trajectories' sampled tokens: completion tokens per trajectory, and the sampling policy's
    # entropy estimate (mean −logprob of the sampled tokens, from the recorded logprobs).
    response_tokens_mean: float | None = None
    sampling_entropy: float | None = None


class StatusEvent(BaseModel):
    """What the job is doing between steps (loading, saving, swapping), and a heartbeat while it waits."""

    type: Literal["status"] = "status"
    stage: str
    message: str = ""
    elapsed_seconds: float = 0.0


class StepEvent(BaseModel):
    type: Literal["step"] = "step"
    gradient_step: int
    num_gradient_steps: int
    loss: float
    policy_loss: float
    kl: float
    entropy: float
    grad_norm: float
    clip_fraction: float
    learning_rate: float
    tokens: int
    seconds: float
    # mean |logπθ - logπ_behaviour| over trainable tokens: engine/trainer drift plus staleness
    logprob_mismatch: float = 0.0
    # positions the decoder ran over in this step: shared prompt prefixes count once per micro-batch
    decoder_positions: int = 0
    # k3 estimate of KL(πθ ‖ base) per trained token, measured before this step's update; None when not
    # measured (only rewarded-group objectives measure it: with kl_beta > 0 or measure_kl_to_base)
    kl_to_base: float | None = None
    objective: str = "grpo"
    # the objective's own statistics (client/README.md lists them per objective)
    metrics: dict[str, float] = Field(default_factory=dict)


class DoneEvent(BaseModel):
    type: Literal["done"] = "done"
    model: str  # "name@N": the step now served under the alias
    step: int
    adapter_path: str | None
    train_seconds: float
    swap_seconds: float
    trained: bool = True  # False when nothing was trainable (reason says why)
    reason: str | None = None


class ErrorEvent(BaseModel):
    type: Literal["error"] = "error"
    message: str
    code: str  # machine-readable: "trainer_crashed", "no_signal", "swap_failed", ...
    served_step: int | None = None  # the step still served (the previous one)


TrainEvent = Annotated[StartEvent | StatusEvent | StepEvent | DoneEvent | ErrorEvent, Field(discriminator="type")]
