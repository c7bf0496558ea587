"""Graders: score a model's output against a dataset row, for rewards and evals. No torch.

Configs are OpenAI's reinforcement fine-tuning grader JSON, verbatim (string_check, text_similarity,
multi, python, score_model, label_model), plus SeekrFlow's math_accuracy and format graders and its
weighted `RewardComponents`, and artlike's reward_model (a trained reward model's score; the caller injects
the `scorer`, as score_model's `judge`):

    >>> from artlike.graders import grade
    >>> grade({"type": "string_check", "name": "exact", "input": "{{sample.output_text}}",
    ...        "reference": "{{item.label}}", "operation": "eq"}, "Paris", {"label": "Paris"}).score
    1.0

The metric packages (sacrebleu, rouge-score, rapidfuzz, math-verify) are the `artlike[graders]` extra,
imported only by the graders that use them.
"""

from ._errors import (
    FormulaError,
    GraderError,
    GraderNotRunnableHere,
    GradingFailed,
    JudgeUnavailable,
    MissingDependencyError,
    PythonGraderFailed,
    ScoreParseError,
    ScorerUnavailable,
    TemplateError,
    UnsupportedMetricError,
)
from ._formula import Formula, compile_formula
from ._grade import AnyGrader, grade, grade_async, normalize_sample, parse_grader
from ._leaf import LEAF_FUNCTIONS, Compute, LeafFunction, run_leaf
from ._model_graders import Judge, PythonRunner, Scorer
from ._reward import RewardComponents
from ._template import render
from ._text_similarity import check_metric
from ._types import (
    FormatGrader,
    GradeError,
    Grader,
    GradeResult,
    JudgeMessage,
    LabelModelGrader,
    MathAccuracyGrader,
    MultiGrader,
    PythonGrader,
    RewardModelGrader,
    ScoreModelGrader,
    StringCheckGrader,
    SubGrader,
    TextSimilarityGrader,
)

__all__ = [
    "LEAF_FUNCTIONS",
    "AnyGrader",
    "Compute",
    "FormatGrader",
    "Formula",
    "FormulaError",
    "GradeError",
    "GradeResult",
    "Grader",
    "GraderError",
    "GraderNotRunnableHere",
    "GradingFailed",
    "Judge",
    "JudgeMessage",
    "JudgeUnavailable",
    "LabelModelGrader",
    "LeafFunction",
    "MathAccuracyGrader",
    "MissingDependencyError",
    "MultiGrader",
    "PythonGrader",
    "PythonGraderFailed",
    "PythonRunner",
    "RewardComponents",
    "RewardModelGrader",
    "ScoreModelGrader",
    "ScoreParseError",
    "Scorer",
    "ScorerUnavailable",
    "StringCheckGrader",
    "SubGrader",
    "TemplateError",
    "TextSimilarityGrader",
    "UnsupportedMetricError",
    "check_metric",
    "compile_formula",
    "grade",
    "grade_async",
    "normalize_sample",
    "parse_grader",
    "render",
    "run_leaf",
]
