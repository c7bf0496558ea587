"""`graders/run` and `graders/validate`: try a grader on one sample before a job uses it.

Graders run here (`artlike.graders`, our own torch-free code); a python grader's code runs in the sandbox
through `python_runner`, score_model / label_model graders ask this server's models through `judge`, and
reward_model graders its reward models through `scorer`. The text graders' own work (text_similarity,
math_accuracy, format) runs in `pool`'s worker processes under a time limit, never on the event loop: one
that runs past it answers 504 `grader_timeout`, a text over the size cap 400 `grader_input_too_large`.
The response is OpenAI's RunGraderResponse: the reward, the error flags, each sub-grader's score.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from pydantic import ValidationError

from artlike.graders import GradeResult, LeafFunction, PythonGrader, grade_async, parse_grader, run_leaf

from ..errors import APIError, InvalidRequest, validation_error
from .grader_pool import GraderInputTooLarge, GraderPool, GraderTimedOut
from .intake import check_grader_runnable, python_graders
from .rewards import Judge, Scorer
from .sandbox import CodeError

PythonSourceRunner = Callable[[str, dict[str, Any], dict[str, Any]], Awaitable[float]]

ERROR_FLAGS = ("formula_parse_error", "sample_parse_error", "truncated_observation_error", "unresponsive_reward_error",
               "invalid_variable_error", "other_error", "python_grader_server_error", "python_grader_runtime_error",
               "model_grader_server_error", "model_grader_refusal_error", "model_grader_parse_error")


class GraderTimeout(APIError):
    status_code = 504
    error_type = "timeout_error"


class GraderService:
    def __init__(self, python_runner: PythonSourceRunner, judge: Judge | None, *,
                 check_source: Callable[[str], None], scorer: Scorer | None = None,
                 pool: GraderPool | None = None, require_sandbox: Callable[[], None] | None = None) -> None:
        self._python_runner = python_runner
        self._require_sandbox = require_sandbox  # raises 503 where python graders may not run
        self._judge = judge
        self._scorer = scorer
        self._check_source = check_source
        self.pool = pool  # None: the text graders run inline (tests of the routes alone)

    async def compute(self, function: LeafFunction, args: list[str]) -> Any:
        """A text grader's work, in the pool when there is one (`grade_async(compute=...)`)."""
        if self.pool is None:
            return run_leaf(function, args)
        return await self.pool.compute(function, args)

    async def close(self) -> None:
        if self.pool is not None:
            await self.pool.close()

    def validate(self, grader: Any) -> Any:
        """The grader parsed and its python sources compiled, or InvalidRequest naming the field."""
        if not isinstance(grader, Mapping):
            raise InvalidRequest("grader must be an object", param="grader", code="invalid_grader")
        try:
            parsed = parse_grader(grader)
        except ValidationError as error:
            raise validation_error(error, prefix="grader", code="invalid_grader") from error
        check_grader_runnable(parsed, param="grader")
        for python in python_graders(parsed):
            try:
                self._check_source(python.source)
            except CodeError as error:
                raise InvalidRequest(f"python grader {python.name!r}: {error}", param="grader.source",
                                     code="invalid_grader") from error
        return parsed

    async def run(self, grader: Any, model_sample: Any, item: Any) -> dict[str, Any]:
        parsed = self.validate(grader)
        if self._require_sandbox is not None and python_graders(parsed):
            self._require_sandbox()
        if not isinstance(model_sample, str):
            raise InvalidRequest("model_sample must be a string", param="model_sample", code="invalid_value")
        if item is not None and not isinstance(item, Mapping):
            raise InvalidRequest("item must be an object", param="item", code="invalid_value")
        if self.pool is not None:
            try:
                self.pool.check_text(model_sample, "model_sample")
            except GraderInputTooLarge as error:
                raise InvalidRequest(str(error), param="model_sample", code="grader_input_too_large") from error
        started = time.monotonic()
        try:
            result = await grade_async(parsed, model_sample, dict(item or {}), judge=self._judge,
                                       python=self._python, scorer=self._scorer, compute=self.compute)
        except GraderInputTooLarge as error:  # a rendered template: the item's text (or the grader's own)
            raise InvalidRequest(str(error), param="item", code="grader_input_too_large") from error
        except GraderTimedOut as error:
            raise GraderTimeout(str(error), param="grader", code="grader_timeout") from error
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
