"""`graders/run` and `graders/validate`: try a grader on one sample before a job uses it.

Graders run here (`artlike.graders`, our own torch-free code); a python grader's code runs in the sandbox
through `python_runner`, score_model / label_model graders ask this server's models through `judge`, and
reward_model graders its reward models through `scorer`. The response is
OpenAI's RunGraderResponse: the reward, the error flags, each sub-grader's score.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from pydantic import ValidationError

from artlike.graders import GradeResult, PythonGrader, grade_async, parse_grader

from ..errors import InvalidRequest, validation_error
from .intake import python_graders
from .rewards import Judge, Scorer
from .sandbox import CodeError

PythonSourceRunner = Callable[[str, dict[str, Any], dict[str, Any]], Awaitable[float]]

ERROR_FLAGS = ("formula_parse_error", "sample_parse_error", "truncated_observation_error", "unresponsive_reward_error",
               "invalid_variable_error", "other_error", "python_grader_server_error", "python_grader_runtime_error",
               "model_grader_server_error", "model_grader_refusal_error", "model_grader_parse_error")


class GraderService:
    def __init__(self, python_runner: PythonSourceRunner, judge: Judge | None, *,
                 check_source: Callable[[str], None], scorer: Scorer | None = None) -> None:
        self._python_runner = python_runner
        self._judge = judge
        self._scorer = scorer
        self._check_source = check_source

    def validate(self, grader: Any) -> Any:
        """The grader parsed and its python sources compiled, or InvalidRequest naming the field."""
        if not isinstance(grader, Mapping):
            raise InvalidRequest("grader must be an object", param="grader", code="invalid_grader")
        try:
            parsed = parse_grader(grader)
        except ValidationError as error:
            raise validation_error(error, prefix="grader", code="invalid_grader") from error
        for python in python_graders(parsed):
            try:
                self._check_source(python.source)
            except CodeError as error:
                raise InvalidRequest(f"python grader {python.name!r}: {error}", param="grader.source",
                                     code="invalid_grader") from error
        return parsed

    async def run(self, grader: Any, model_sample: Any, item: Any) -> dict[str, Any]:
        parsed = self.validate(grader)
        if not isinstance(model_sample, str):
            raise InvalidRequest("model_sample must be a string", param="model_sample", code="invalid_value")
        if item is not None and not isinstance(item, Mapping):
            raise InvalidRequest("item must be an object", param="item", code="invalid_value")
        started = time.monotonic()
        result = await grade_async(parsed, model_sample, dict(item or {}), judge=self._judge, python=self._python,
                                   scorer=self._scorer)
        return run_response(result, time.monotonic() - started)

    async def _python(self, grader: PythonGrader, sample: dict[str, Any], item: Mapping[str, Any]) -> float:
        return await self._python_runner(grader.source, sample, dict(item))


def run_response(result: GradeResult, seconds: float) -> dict[str, Any]:
    """OpenAI's RunGraderResponse for one graded sample."""
    errors: dict[str, Any] = dict.fromkeys(ERROR_FLAGS, False) | {
        "python_grader_server_error_type": None, "python_grader_runtime_error_details": None,
        "model_grader_server_error_details": None}
    if result.error is not None:
        errors[result.error.kind] = True
        if result.error.kind == "python_grader_runtime_error":
            errors["python_grader_runtime_error_details"] = result.error.message
        if result.error.kind == "model_grader_server_error":
            errors["model_grader_server_error_details"] = result.error.message
    return {
        "reward": result.score,
        "metadata": {"name": result.name, "type": result.type, "errors": errors,
                     "execution_time": round(seconds, 6), "scores": result.sub_scores or {result.name: result.score},
                     "token_usage": None, "sampled_model_name": None},
        "sub_rewards": result.sub_scores,
        "model_grader_token_usage_per_model": {},
    }
