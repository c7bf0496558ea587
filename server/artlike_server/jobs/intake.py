"""What both front doors check before a job exists: the model, the rows, the reward code or grader.

Everything here raises `InvalidRequest` (400, OpenAI error shape) naming the parameter, the line and the
field; user code is compiled, never run, in this process.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from artlike import DynamicSampling
from artlike.graders import (
    AnyGrader,
    MultiGrader,
    PythonGrader,
    RewardComponents,
    TextSimilarityGrader,
    UnsupportedMetricError,
    check_metric,
    parse_grader,
)

from ..errors import InvalidRequest, validation_error
from ..models.store import ModelStore
from .datasets import DatasetError, PromptRow, parse_prompt_rows
from .sandbox import CodeError, check_program
from .spec import GraderReward, PythonReward, RemedySettings

REWARD_ENTRIES = ("reward_fn", "grade")
MAX_TRAIN_ROWS = 100_000
MAX_SUBGRADERS = 16  # graders in one multi grader or RewardComponents


@dataclass(frozen=True)
class Target:
    base_model: str
    target_model: str
    create: bool  # a new model named for the job; False: an existing trainable model trained in place


def resolve_target(model: str, *, served_base: str, models: ModelStore, suffix: str | None, param: str) -> Target:
    """`model` is this server's base model (a new `ft-...` model is made) or a trainable model (trained in place)."""
    if model == served_base:
        label = re.sub(r"[^A-Za-z0-9._-]", "-", suffix or "job").strip("-._")[:40] or "job"
        return Target(served_base, f"ft-{label}-{secrets.token_hex(4)}", True)
    stored = models.get(model) if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", model) else None
    if stored is not None:
        return Target(stored.base_model, model, False)
    raise InvalidRequest(f"model {model!r} is not served here: use the base model {served_base!r} or the name of "
                         "a trainable model", param=param, code="model_not_found")


def prompt_rows(content: bytes | Sequence[Mapping[str, Any]], *, param: str) -> list[PromptRow]:
    try:
        rows = parse_prompt_rows(content, max_rows=MAX_TRAIN_ROWS)
    except DatasetError as error:
        raise InvalidRequest(str(error), param=param, code="invalid_dataset") from error
    return rows


def python_reward(source: str, *, param: str, pass_threshold: float | None = None) -> PythonReward:
    """Compiled here, never run. The scoring function is OpenAI's `grade(sample, item)`, MotteRL's
    `reward_fn(completion, **kwargs)`, or, as in MotteRL's own examples (`multi_criteria_reward`), the
    module's only function."""
    try:
        functions = check_program(source, require_one_of=())
    except CodeError as error:
        raise InvalidRequest(f"reward code: {error}", param=param, code="invalid_reward_code") from error
    public = sorted(f for f in functions if not f.startswith("_") and f != "next_turn")
    entry = next((name for name in REWARD_ENTRIES if name in functions), public[0] if len(public) == 1 else None)
    if entry is None:
        found = f"it defines {', '.join(public)}" if public else "it defines no function"
        raise InvalidRequest(f"reward code: define reward_fn(completion, **kwargs) -> float (or OpenAI's "
                             f"grade(sample, item)); {found}", param=param, code="invalid_reward_code")
    return PythonReward(source=source, entry=entry, functions=tuple(sorted(functions)), pass_threshold=pass_threshold)


def grader_reward(grader: Mapping[str, Any], *, param: str) -> PythonReward | GraderReward:
    """A top-level python grader runs as user code (its module may also define tools and next_turn);
    anything else is a grader config, whose nested python graders are compiled here."""
    try:
        parsed = parse_grader(grader)
    except ValidationError as error:
        raise validation_error(error, prefix=param, code="invalid_grader") from error
    check_grader_runnable(parsed, param=param)
    if isinstance(parsed, PythonGrader):
        return python_reward(parsed.source, param=f"{param}.source", pass_threshold=parsed.pass_threshold)
    nested = python_graders(parsed)
    for python in nested:
        try:
            check_program(python.source, require_one_of=("grade",))
        except CodeError as error:
            raise InvalidRequest(f"python grader {python.name!r}: {error}", param=param,
                                 code="invalid_reward_code") from error
    threshold = getattr(parsed, "pass_threshold", None)
    return GraderReward(grader=dict(grader), pass_threshold=threshold if isinstance(threshold, float) else None)


REMEDY_FIELDS = tuple(RemedySettings.model_fields)  # the request fields of a job's remedies, in both doors


def remedy_settings(fields: Mapping[str, Any], *, param: str | None,
                    wire_names: Mapping[str, str] | None = None) -> RemedySettings:
    """A job's remedies from the request's fields (None: not given; `dynamic_sampling` true: its defaults). A
    bad value is a 400 naming its field as the request spelled it (`wire_names`: field → the request's name),
    under `param`."""
    given = {name: value for name, value in fields.items() if value is not None and value is not False}
    if given.get("dynamic_sampling") is True:
        given["dynamic_sampling"] = DynamicSampling()
    try:
        return RemedySettings.model_validate(given)
    except ValidationError as error:
        first = error.errors()[0]
        loc = [str(part) for part in first.get("loc", ())]
        if loc and wire_names:
            loc[0] = wire_names.get(loc[0], loc[0])
        name = ".".join([param, *loc] if param else loc) or None
        message = str(first.get("msg"))
        raise InvalidRequest(f"{name}: {message}" if name else message, param=name, code="invalid_value") from error


def check_episode_functions(rows: Sequence[PromptRow], reward: PythonReward | GraderReward, *, multi_step: bool,
                            param: str) -> None:
    """Tools a row offers and multi-step turns need their functions in the reward module."""
    functions = set(reward.functions)
    if multi_step and "next_turn" not in functions:
        raise InvalidRequest("multi-step training needs `next_turn(messages, **kwargs) -> str | None` in the reward "
                             "code (it gives the next user message; None ends the episode)", param=param,
                             code="missing_function")
    for row in rows:
        for tool in row.tools or []:
            name = (tool.get("function") or {}).get("name") if isinstance(tool, dict) else None
            if name and name not in functions:
                raise InvalidRequest(f"line {row.line}: the row offers tool {name!r} but the reward code defines no "
                                     f"function {name}(**arguments) to run it", param=param,
                                     code="missing_function")


def check_guide_field(rows: Sequence[PromptRow], remedies: RemedySettings, *, param: str) -> None:
    """A guide field names a field some training row has: a misspelt one would silently guide nothing."""
    name = remedies.guide_field
    if name is not None and not any(row.item.get(name) not in (None, "") for row in rows):
        raise InvalidRequest(f"no training row has a value in {name!r}, the field guide_field names (the reference "
                             "answer that joins a group whose rollouts all failed)", param=param,
                             code="invalid_value")


def check_grade_source(source: str) -> None:
    """A python grader's source compiles and defines `grade(sample, item)` (raises CodeError otherwise)."""
    check_program(source, require_one_of=("grade",))


def _members(grader: AnyGrader) -> list[Any]:
    """The graders of a multi or RewardComponents; a single grader is its own only member."""
    if isinstance(grader, MultiGrader):
        inner = grader.graders
        return list(inner.values()) if isinstance(inner, dict) else inner if isinstance(inner, list) else [inner]
    if isinstance(grader, RewardComponents):
        return list(grader.graders)
    return [grader]


def python_graders(grader: AnyGrader) -> list[PythonGrader]:
    """The python graders in a grader config: itself, or the members of a multi or RewardComponents."""
    return [g for g in _members(grader) if isinstance(g, PythonGrader)]


def check_grader_runnable(grader: AnyGrader, *, param: str) -> None:
    """Each grader of a sample is a computation (and maybe a judge call), each bounded by the grader time
    limit: a multi grader or RewardComponents holds at most MAX_SUBGRADERS. A text_similarity metric this
    server cannot compute is refused here too (400), before any sample is graded."""
    count = len(_members(grader))
    if count > MAX_SUBGRADERS:
        raise InvalidRequest(f"the grader combines {count} graders; at most {MAX_SUBGRADERS} are allowed",
                             param=f"{param}.graders", code="too_many_graders")
    for member in _members(grader):
        if isinstance(member, TextSimilarityGrader):
            try:
                check_metric(member.evaluation_metric)
            except UnsupportedMetricError as error:
                raise InvalidRequest(str(error), param=f"{param}.evaluation_metric",
                                     code="unsupported_metric") from error


def runs_user_code(reward: PythonReward | GraderReward | None) -> bool:
    """Whether a job's reward runs user code in the sandbox: python, a module of tools / next_turn, or a
    python grader anywhere in its grader."""
    if reward is None:
        return False
    if isinstance(reward, PythonReward) or reward.source is not None:
        return True
    return bool(python_graders(parse_grader(reward.grader)))
