"""`grade()`: one grader config, one model sample, one dataset item -> a GradeResult.

The core is async (a score_model's judge or a reward_model's scorer may be); `grade()` drives it without an
event loop, which works because nothing in it suspends unless an async judge or scorer does, and `grade()`
refuses async ones.
"""

from __future__ import annotations

import inspect
import json
import math
import re
from collections.abc import Awaitable, Coroutine, Mapping
from typing import Any, TypeVar

from pydantic import TypeAdapter

from ._errors import FormulaError, GraderNotRunnableHere, GradingFailed, PythonGraderFailed, ScoreParseError
from ._formula import compile_formula
from ._leaf import Compute, LeafFunction, run_leaf
from ._model_graders import (
    Judge,
    PythonRunner,
    Scorer,
    parse_label,
    parse_score,
    render_messages,
    scored_conversation,
)
from ._reward import RewardComponents
from ._template import lookup, render, sample_from_text
from ._text_similarity import check_metric
from ._types import (
    FormatGrader,
    GradeError,
    Grader,
    GradeResult,
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

T = TypeVar("T")

AnyGrader = Grader | RewardComponents
_GRADER: TypeAdapter[Grader] = TypeAdapter(Grader)


def parse_grader(config: Mapping[str, Any]) -> AnyGrader:
    """An OpenAI or SeekrFlow grader (it has a `type`), or SeekrFlow's RewardComponents (it has none)."""
    if "type" in config:
        return _GRADER.validate_python(config)
    return RewardComponents.model_validate(config)


def normalize_sample(sample: Mapping[str, Any] | str) -> dict[str, Any]:
    """OpenAI's sample namespace: `output_text`, plus `output_json` when that text is JSON."""
    if isinstance(sample, str):
        return sample_from_text(sample)
    out = dict(sample)
    if "output_text" not in out and out.get("choices"):
        content = out["choices"][0].get("message", {}).get("content")
        if isinstance(content, str):
            out["output_text"] = content
    if "output_json" not in out and isinstance(out.get("output_text"), str):
        out.update({k: v for k, v in sample_from_text(out["output_text"]).items() if k == "output_json"})
    return out


def _passed(score: float, threshold: float | None) -> bool | None:
    return None if threshold is None else score >= threshold


async def _settled(value: T | Awaitable[T], sync: bool, what: str) -> T:
    """A callback's result, awaited when it is awaitable (refused when grading runs without a loop)."""
    if inspect.isawaitable(value):
        if sync:
            if inspect.iscoroutine(value):
                value.close()
            raise TypeError(f"the {what} is async: call grade_async()")
        return await value
    return value


async def _call_judge(judge: Judge | None, messages: list[dict[str, Any]], model: str, sync: bool) -> str:
    if judge is None:
        raise GraderNotRunnableHere("model graders need a judge: grade(..., judge=callable(messages, model))")
    answer = await _settled(judge(messages, model), sync, "judge")
    if not isinstance(answer, str):
        raise TypeError(f"the judge must return the model's text, not {type(answer).__name__}")
    return answer


async def _call_scorer(scorer: Scorer | None, messages: list[dict[str, Any]], model: str, sync: bool) -> float:
    if scorer is None:
        raise GraderNotRunnableHere(
            f"reward_model graders need a scorer of reward model {model!r}: grade(..., scorer=callable(messages, "
            "model) -> float) (the server's jobs and graders/run use its POST /v1/rewards)")
    score = await _settled(scorer(messages, model), sync, "scorer")
    if isinstance(score, bool) or not isinstance(score, int | float):
        raise TypeError(f"the scorer must return the reward model's score as a number, not {type(score).__name__}")
    if not math.isfinite(score):
        raise ScoreParseError(f"the reward model {model!r} scored {score!r}, not a finite number")
    return float(score)


def _variable_names(graders: dict[str, SubGrader] | list[SubGrader] | SubGrader) -> dict[str, SubGrader]:
    if isinstance(graders, dict):
        return graders
    named: dict[str, SubGrader] = {}
    for g in graders if isinstance(graders, list) else [graders]:
        key = re.sub(r"\W", "_", g.name or g.type)
        key = "_" + key if key[:1].isdigit() else key
        if key in named:
            raise FormulaError(f"two graders are called {key!r}: give a multi grader a dict of graders")
        named[key] = g
    return named


class _Grading:
    def __init__(self, judge: Judge | None, sync: bool, python: PythonRunner | None = None,
                 scorer: Scorer | None = None, compute: Compute | None = None) -> None:
        self.judge, self.sync, self.python, self.scorer, self.compute = judge, sync, python, scorer, compute

    async def _leaf(self, function: LeafFunction, args: list[str]) -> Any:
        if self.compute is None:
            return run_leaf(function, args)
        return await _settled(self.compute(function, args), self.sync, "compute")

    async def run(self, grader: AnyGrader, sample: dict[str, Any], item: Mapping[str, Any]) -> GradeResult:
        name, kind = ("reward_components", "reward_components") if isinstance(grader, RewardComponents) \
            else (grader.name or grader.type, grader.type)
        try:
            result = await self._dispatch(grader, sample, item)
        except GradingFailed as e:
            return GradeResult(name=name, type=kind, score=0.0, error=GradeError(kind=e.kind, message=str(e)))
        return result.model_copy(update={"name": name, "type": kind})

    async def _dispatch(self, g: AnyGrader, sample: dict[str, Any], item: Mapping[str, Any]) -> GradeResult:
        def r(template: str) -> str:
            return render(template, sample, item)

        result = GradeResult(name="", type="", score=0.0)
        if isinstance(g, StringCheckGrader):
            score = float(await self._leaf("string_check", [r(g.input), r(g.reference), g.operation]))
            return result.model_copy(update={"score": score})
        if isinstance(g, TextSimilarityGrader):
            check_metric(g.evaluation_metric)
            score = float(await self._leaf("similarity", [r(g.input), r(g.reference), g.evaluation_metric]))
            return result.model_copy(update={"score": score, "passed": _passed(score, g.pass_threshold)})
        if isinstance(g, MathAccuracyGrader):
            score, answer = await self._leaf("math_accuracy", [r(g.input), r(g.reference)])
            return result.model_copy(update={"score": float(score), "metadata": {"answer": answer}})
        if isinstance(g, FormatGrader):
            score, answer = await self._leaf("format", [r(g.input)])
            return result.model_copy(update={"score": float(score), "metadata": {"answer": answer}})
        if isinstance(g, PythonGrader):
            score = await self._run_python(g, sample, item)
            return result.model_copy(update={"score": score, "passed": _passed(score, g.pass_threshold)})
        if isinstance(g, ScoreModelGrader | LabelModelGrader):
            answer = await _call_judge(self.judge, render_messages(g.input, sample, item), g.model, self.sync)
            if isinstance(g, LabelModelGrader):
                label = parse_label(answer, g.labels)
                ok = label in g.passing_labels
                return result.model_copy(update={
                    "score": float(ok), "passed": ok, "metadata": {"label": label, "judge_answer": answer}})
            score = parse_score(answer, g.range)
            return result.model_copy(update={"score": score, "passed": _passed(score, g.pass_threshold),
                                             "metadata": {"judge_answer": answer}})
        if isinstance(g, RewardModelGrader):
            score = await _call_scorer(self.scorer, scored_conversation(g, sample, item), g.model, self.sync)
            return result.model_copy(update={"score": score, "passed": _passed(score, g.pass_threshold)})
        if isinstance(g, MultiGrader):
            return await self._multi(g, sample, item)
        return await self._reward_components(g, sample, item)

    async def _run_python(self, g: PythonGrader, sample: dict[str, Any], item: Mapping[str, Any]) -> float:
        if self.python is None:
            raise GraderNotRunnableHere(
                f"python grader {g.name!r} runs untrusted code: only the server's sandbox runs it")
        score = await _settled(self.python(g, sample, item), self.sync, "python runner")
        if isinstance(score, bool) or not isinstance(score, int | float) or not math.isfinite(score):
            raise PythonGraderFailed(f"python grader {g.name!r} returned {score!r}, not a finite number")
        return float(score)

    async def _sub_results(
        self, graders: dict[str, SubGrader] | dict[str, Grader], sample: dict[str, Any],
        item: Mapping[str, Any],
    ) -> tuple[dict[str, GradeResult], GradeError | None]:
        results = {key: await self.run(g, sample, item) for key, g in graders.items()}
        failed = next(((k, r.error) for k, r in results.items() if r.error is not None), None)
        error = None if failed is None or failed[1] is None else \
            GradeError(kind=failed[1].kind, message=f"{failed[0]}: {failed[1].message}")
        return results, error

    async def _multi(self, g: MultiGrader, sample: dict[str, Any], item: Mapping[str, Any]) -> GradeResult:
        graders = _variable_names(g.graders)
        formula = compile_formula(g.calculate_output, set(graders))  # before any judge is paid for
        results, error = await self._sub_results(graders, sample, item)
        sub_scores = {k: r.score for k, r in results.items()}
        if error is not None:
            return GradeResult(name="", type="", score=0.0, sub_scores=sub_scores, error=error)
        return GradeResult(name="", type="", score=formula.evaluate(sub_scores), sub_scores=sub_scores)

    async def _reward_components(
        self, g: RewardComponents, sample: dict[str, Any], item: Mapping[str, Any]
    ) -> GradeResult:
        format_score, answer = await self._leaf("format", [str(lookup("sample.output_text", sample, item))])
        format_score = float(format_score)
        if g.extract_answer and answer is not None:
            sample = {**sample, "output_text": answer, **_json_of(answer)}
        keys: dict[str, Grader] = {}
        for grader in g.graders:
            key = base = grader.name or grader.type
            n = 1
            while key in keys or key == "format":
                n += 1
                key = f"{base}_{n}"
            keys[key] = grader
        results, error = await self._sub_results(keys, sample, item)
        format_weight, weights = g.resolved_weights()
        sub_scores = {"format": format_score} | {k: r.score for k, r in results.items()}
        metadata = {"answer": answer,
                    "weights": {"format": format_weight} | dict(zip(keys, weights, strict=True))}
        if error is not None:
            return GradeResult(name="", type="", score=0.0, sub_scores=sub_scores, metadata=metadata,
                               error=error)
        score = format_weight * format_score + math.fsum(
            w * r.score for w, r in zip(weights, results.values(), strict=True))
        return GradeResult(name="", type="", score=score, sub_scores=sub_scores, metadata=metadata)


def _json_of(text: str) -> dict[str, Any]:
    """`output_json` for a new output_text: the parsed text, or none (dropping the old one)."""
    try:
        return {"output_json": json.loads(text)}
    except ValueError:
        return {"output_json": None}


def _drive(coro: Coroutine[Any, Any, GradeResult]) -> GradeResult:
    try:
        coro.send(None)
    except StopIteration as done:
        result: GradeResult = done.value
        return result
    coro.close()
    raise RuntimeError("grading suspended outside an event loop: call grade_async()")


def grade(
    grader: AnyGrader | Mapping[str, Any],
    sample: Mapping[str, Any] | str,
    item: Mapping[str, Any] | None = None,
    *,
    judge: Judge | None = None,
    python: PythonRunner | None = None,
    scorer: Scorer | None = None,
    compute: Compute | None = None,
) -> GradeResult:
    """Grade one sample. Per-sample failures (a missing template key, a bad formula, a judge answer with no
    score, a reward model that could not score) come back as `result.error` with score 0; python graders
    need `python=` (the server's sandbox runs them), score_model and label_model a `judge=`, reward_model a
    `scorer=`, and each raises GraderNotRunnableHere without it. `compute=` runs the text graders' work
    elsewhere (see `run_leaf`); by default it runs here."""
    g = parse_grader(grader) if isinstance(grader, Mapping) else grader
    grading = _Grading(judge, sync=True, python=python, scorer=scorer, compute=compute)
    return _drive(grading.run(g, normalize_sample(sample), item or {}))


async def grade_async(
    grader: AnyGrader | Mapping[str, Any],
    sample: Mapping[str, Any] | str,
    item: Mapping[str, Any] | None = None,
    *,
    judge: Judge | None = None,
    python: PythonRunner | None = None,
    scorer: Scorer | None = None,
    compute: Compute | None = None,
) -> GradeResult:
    """`grade()` for an async judge, scorer, python runner or compute (sync ones work too)."""
    g = parse_grader(grader) if isinstance(grader, Mapping) else grader
    grading = _Grading(judge, sync=False, python=python, scorer=scorer, compute=compute)
    return await grading.run(g, normalize_sample(sample), item or {})
