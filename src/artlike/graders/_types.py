"""Grader configs (pydantic): OpenAI's grader JSON shapes verbatim, plus SeekrFlow's graders and names.

SeekrFlow graders carry no `input`/`reference`: they compare the model's output with the dataset row's
`reference_answer`, so those are the defaults here. SeekrFlow's operation names are accepted and mapped
onto OpenAI's (`equals` -> `eq`, `bleu`/`rouge` as `evaluation_metric`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from ..types import MODEL_REFERENCE_PATTERN
from ._errors import ErrorKind

DEFAULT_INPUT = "{{sample.output_text}}"
DEFAULT_REFERENCE = "{{item.reference_answer}}"

_STRING_OPS = {"equals": "eq", "not_equals": "ne", "contains": "like", "case_insensitive_contains": "ilike"}
# SeekrFlow's `rouge` names no variant; ROUGE-L is the usual single-number ROUGE.
_METRIC_ALIASES = {"rouge": "rouge_l", "rougel": "rouge_l", "fuzzy": "fuzzy_match"}


def _string_op(v: Any) -> Any:
    return _STRING_OPS.get(v.lower(), v.lower()) if isinstance(v, str) else v


def _metric(v: Any) -> Any:
    return _METRIC_ALIASES.get(v.lower(), v.lower()) if isinstance(v, str) else v


StringOperation = Annotated[Literal["eq", "ne", "like", "ilike"], BeforeValidator(_string_op)]
EvaluationMetric = Annotated[
    Literal["cosine", "fuzzy_match", "bleu", "gleu", "meteor",
            "rouge_1", "rouge_2", "rouge_3", "rouge_4", "rouge_5", "rouge_l"],
    BeforeValidator(_metric),
]


class _GraderBase(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(None, description="OpenAI requires it; defaults to the grader type here.")
    weight: float | None = Field(None, ge=0.0, le=1.0, description="Only inside SeekrFlow's RewardComponents.")


class StringCheckGrader(_GraderBase):
    type: Literal["string_check"] = "string_check"
    input: str = DEFAULT_INPUT
    reference: str = DEFAULT_REFERENCE
    operation: StringOperation


class TextSimilarityGrader(_GraderBase):
    type: Literal["text_similarity"] = "text_similarity"
    input: str = DEFAULT_INPUT
    reference: str = DEFAULT_REFERENCE
    evaluation_metric: EvaluationMetric
    pass_threshold: float | None = None

    @model_validator(mode="before")
    @classmethod
    def _seekrflow_operation(cls, data: Any) -> Any:
        # SeekrFlow spells the metric `operation`.
        if isinstance(data, dict) and "operation" in data and "evaluation_metric" not in data:
            data = {**data, "evaluation_metric": data["operation"]}
            del data["operation"]
        return data


class MathAccuracyGrader(_GraderBase):
    """SeekrFlow's numerical accuracy: 1 if the final answer in `input` equals `reference` mathematically."""

    type: Literal["math_accuracy"] = "math_accuracy"
    input: str = DEFAULT_INPUT
    reference: str = DEFAULT_REFERENCE


class FormatGrader(_GraderBase):
    """SeekrFlow's format reward: 1 if `input` is `<think>…</think><answer>…</answer>`, else 0."""

    type: Literal["format"] = "format"
    input: str = DEFAULT_INPUT


class PythonGrader(_GraderBase):
    type: Literal["python"] = "python"
    source: str
    image_tag: str | None = None
    pass_threshold: float | None = None


class JudgeMessage(BaseModel):
    """OpenAI's EvalItem: content is a string, one content part, or a list of parts (templates allowed)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | dict[str, Any] | list[dict[str, Any]]


class ScoreModelGrader(_GraderBase):
    type: Literal["score_model"] = "score_model"
    model: str
    input: list[JudgeMessage]
    range: tuple[float, float] = (0.0, 1.0)
    sampling_params: dict[str, Any] | None = None
    pass_threshold: float | None = None

    @model_validator(mode="after")
    def _range_order(self) -> ScoreModelGrader:
        if not self.range[0] < self.range[1]:
            raise ValueError(f"range must be [low, high] with low < high, got {list(self.range)}")
        return self


class LabelModelGrader(_GraderBase):
    type: Literal["label_model"] = "label_model"
    model: str
    input: list[JudgeMessage]
    labels: list[str] = Field(min_length=1)
    passing_labels: list[str]

    @model_validator(mode="after")
    def _passing_subset(self) -> LabelModelGrader:
        extra = set(self.passing_labels) - set(self.labels)
        if extra:
            raise ValueError(f"passing_labels {sorted(extra)} are not in labels {self.labels}")
        return self


class RewardModelGrader(_GraderBase):
    """artlike's: the score a reward model (a model registered with kind "reward", served by `POST
    /v1/rewards`) gives the conversation that ends with the sample.

    What it scores, as score_model builds what it judges: the prompt is `input` (messages with
    `{{item.*}}`/`{{sample.*}}` templates) or, by default, the item's own prompt: its `messages` (OpenAI's
    chat rows), else its `prompt` as one user message (MotteRL's rows); then the sample as the assistant's
    answer (`output_text`, and its `output_tools` as `tool_calls` when it made any). A multi-turn episode is
    scored on its final answer after the row's prompt, like `{{sample.output_text}}` in a score_model. The
    row's `tools` are not sent. The score is the reward model's combined score (Σ wₖ·sₖ), on its own scale:
    not clamped, not normalised."""

    type: Literal["reward_model"] = "reward_model"
    model: str = Field(pattern=MODEL_REFERENCE_PATTERN, description="A reward model: `name` or `name@N`.")
    input: list[JudgeMessage] | None = Field(
        None, description="The prompt to score the answer after (default: the item's `messages` or `prompt`).")
    pass_threshold: float | None = None


SubGrader = Annotated[
    StringCheckGrader | TextSimilarityGrader | MathAccuracyGrader | FormatGrader | PythonGrader
    | ScoreModelGrader | LabelModelGrader | RewardModelGrader,
    Field(discriminator="type"),
]
"""What a multi grader may contain: every grader but another multi (as OpenAI)."""


class MultiGrader(_GraderBase):
    """`graders` is a dict keyed by the formula's variable names (OpenAI's guide); a list or a single grader
    (the API spec's shape) is keyed by each grader's name, non-identifier characters turned into `_`."""

    type: Literal["multi"] = "multi"
    graders: dict[str, SubGrader] | list[SubGrader] | SubGrader
    calculate_output: str


Grader = Annotated[
    StringCheckGrader | TextSimilarityGrader | MathAccuracyGrader | FormatGrader | PythonGrader
    | ScoreModelGrader | LabelModelGrader | RewardModelGrader | MultiGrader,
    Field(discriminator="type"),
]


class GradeError(BaseModel):
    kind: ErrorKind
    message: str


class GradeResult(BaseModel):
    """One grader's verdict on one sample. `score` is in [0, 1] for every grader but score_model (its
    `range`), reward_model (the reward model's scale) and multi (whatever `calculate_output` computes)."""

    name: str
    type: str
    score: float
    passed: bool | None = Field(None, description="score >= pass_threshold, where the grader has one")
    sub_scores: dict[str, float] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)
    error: GradeError | None = None
