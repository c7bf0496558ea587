"""Errors raised by `artlike.graders`.

    GraderError                  base
    ├── GradingFailed            an expected failure for one sample: `grade()` reports it in
    │   │                        `GradeResult.error` (kind) with score 0 instead of raising
    │   ├── TemplateError        a `{{namespace.path}}` the item or sample does not have
    │   ├── FormulaError         a `calculate_output` that does not parse or evaluate
    │   ├── ScoreParseError      a judge model's answer without a usable score or label
    │   ├── PythonGraderFailed   a python grader's code failed where it ran (the sandbox)
    │   ├── JudgeUnavailable     a model grader's judge could not be asked
    │   └── ScorerUnavailable    a reward_model grader's reward model could not score
    ├── GraderNotRunnableHere    python graders: they need the server's sandbox (never exec'd here);
    │                            model graders without their judge or scorer
    ├── UnsupportedMetricError   a text_similarity metric this library cannot compute
    └── MissingDependencyError   the `graders` extra is not installed (also an ImportError)
"""

from __future__ import annotations

from typing import Literal

ErrorKind = Literal[
    # OpenAI's RunGraderResponse error flags, where one fits
    "formula_parse_error",
    "sample_parse_error",
    "invalid_variable_error",
    "model_grader_parse_error",
    "python_grader_runtime_error",
    "model_grader_server_error",
    "other_error",
]

GRADERS_EXTRA = "artlike[graders]"


class GraderError(Exception):
    """Base class of every error `artlike.graders` raises on purpose."""


class GradingFailed(GraderError):
    kind: ErrorKind = "other_error"


class TemplateError(GradingFailed):
    """A template names a key the item or sample lacks. `path` is the full dotted name, e.g. `item.a.b`."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        # A missing `sample.output_json...` is the model's fault (bad JSON); anything else is the config's.
        self.kind = "sample_parse_error" if path.startswith("sample.output_json") else "invalid_variable_error"
        super().__init__(f"template variable {{{{{path}}}}}: {reason}")


class FormulaError(GradingFailed):
    kind: ErrorKind = "formula_parse_error"


class ScoreParseError(GradingFailed):
    kind: ErrorKind = "model_grader_parse_error"


class PythonGraderFailed(GradingFailed):
    """A python grader's code raised, timed out, or returned no finite number (reported by the runner)."""

    kind: ErrorKind = "python_grader_runtime_error"


class JudgeUnavailable(GradingFailed):
    """The judge model could not be asked (its server answered with an error or not at all)."""

    kind: ErrorKind = "model_grader_server_error"


class ScorerUnavailable(GradingFailed):
    """A reward_model grader's reward model could not score (its server answered with an error or not at all)."""

    kind: ErrorKind = "model_grader_server_error"


class GraderNotRunnableHere(GraderError):
    """This grader needs what this process was not given: the server's sandbox (python graders, never run
    here), a `judge` (score_model, label_model) or a `scorer` (reward_model)."""


class UnsupportedMetricError(GraderError, ValueError):
    pass


class MissingDependencyError(GraderError, ImportError):
    def __init__(self, package: str, what: str) -> None:
        super().__init__(f"{what} needs the {package!r} package: pip install '{GRADERS_EXTRA}'")
