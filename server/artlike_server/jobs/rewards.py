"""Score a finished episode with the job's reward: user code in the sandbox, or graders in this process.

A reward that raises, times out, returns a non-number or NaN scores 0 and carries the reason (`Score.error`,
with the user's traceback when there is one): the runner counts it and reports the first ones as events.
Graders are our own torch-free code (`artlike.graders`): their logic runs here and their text work in the
grader pool's worker processes (`compute`, under a time limit; a grader that runs past it scores 0 with the
reason); a `python` grader nested in them and every user function (reward_fn, grade, next_turn, tools) run
in the sandbox. Model graders are clients of
this server's own HTTP API: score_model / label_model ask a model through chat completions (`ServerJudge`),
reward_model asks a reward model through `POST /v1/rewards` (`ServerScorer`).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
import orjson

from artlike.graders import (
    Compute,
    JudgeUnavailable,
    PythonGrader,
    PythonGraderFailed,
    ScorerUnavailable,
    grade_async,
    parse_grader,
)
from artlike.types import RewardsResponse

from .grader_pool import GraderInputTooLarge, GraderTimedOut
from .sandbox import CallResult, Sandbox
from .spec import GraderReward, PythonReward, Reward


@dataclass(frozen=True)
class Score:
    value: float
    error: str | None = None  # why the sample scored 0: one line, then the user's traceback when any


class Judge(Protocol):
    async def __call__(self, messages: list[dict[str, Any]], model: str) -> str: ...


class Scorer(Protocol):
    async def __call__(self, messages: list[dict[str, Any]], model: str) -> float: ...


def text_of(content: Any) -> str:
    """A message's content as text: a string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


def sample_of(completion: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """OpenAI's grader `sample` for an episode: the last assistant message's text and tool calls."""
    last: Mapping[str, Any] = next((m for m in reversed(completion) if m.get("role") == "assistant"), {})
    return {"output_text": text_of(last.get("content")), "output_tools": list(last.get("tool_calls") or [])}


def reward_value(value: Any, function: str) -> Score:
    """A user function's return value as a reward: a finite number (bools count as 0/1), else 0 with why."""
    if isinstance(value, bool | int | float) and math.isfinite(float(value)):
        return Score(float(value))
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return Score(0.0, f"{function} returned {shown} ({type(value).__name__}), not a finite number")


def failure_text(function: str, result: CallResult) -> str:
    assert result.failure is not None
    text = f"{function}: {result.failure.kind}: {result.failure.message}"
    return f"{text}\n{result.failure.traceback}" if result.failure.traceback else text


class ServerJudge:
    """`score_model` / `label_model` graders ask one of this server's models (or any OpenAI-compatible
    endpoint) through plain chat completions; not recorded as trajectories."""

    def __init__(self, base_url: str, api_key: str | None, *, timeout_s: float = 120.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout_s)

    async def __call__(self, messages: list[dict[str, Any]], model: str) -> str:
        try:
            response = await self._http.post("/v1/chat/completions", json={
                "model": model, "messages": messages, "temperature": 0.0, "max_tokens": 256})
        except httpx.HTTPError as error:
            raise JudgeUnavailable(f"the judge {model!r} did not answer: {type(error).__name__}: {error}") from error
        if response.is_error:
            raise JudgeUnavailable(f"the judge {model!r} answered {response.status_code}: {error_message(response)}")
        return text_of(response.json()["choices"][0]["message"].get("content"))

    async def aclose(self) -> None:
        await self._http.aclose()


class ServerScorer:
    """`reward_model` graders ask one of this server's reward models through `POST /v1/rewards` (one
    conversation per call); the score is the model's combined score. Any error answer (an unknown model, a
    policy instead of a reward model, a conversation over the length limit, the trainer busy too long) or no
    answer is `ScorerUnavailable`: that sample scores 0 with the reason."""

    def __init__(self, base_url: str, api_key: str | None, *, timeout_s: float = 120.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout_s, transport=transport)

    async def __call__(self, messages: list[dict[str, Any]], model: str) -> float:
        try:
            response = await self._http.post("/v1/rewards", json={"model": model, "inputs": [messages]})
        except httpx.HTTPError as error:
            raise ScorerUnavailable(f"the reward model {model!r} did not answer: {type(error).__name__}: "
                                    f"{error}") from error
        if response.is_error:
            raise ScorerUnavailable(f"the reward model {model!r} answered {response.status_code}: "
                                    f"{error_message(response)}")
        return RewardsResponse.model_validate_json(response.content).data[0].score

    async def aclose(self) -> None:
        await self._http.aclose()


def error_message(response: httpx.Response) -> str:
    """The message of an error answer: OpenAI's `error.message` when the body is one, else the body."""
    if response.headers.get("content-type", "").startswith("application/json"):
        body = response.json()
        error = body.get("error") if isinstance(body, dict) else None
        message = error.get("message") if isinstance(error, dict) else None
        if isinstance(message, str):
            return message
    return response.text


def python_grader_runner(sandbox: Sandbox) -> Callable[[str, dict[str, Any], dict[str, Any]], Awaitable[float]]:
    """`graders/run`'s python graders: `grade(sample, item)` in the sandbox; a failure is that grader's error."""

    async def run(source: str, sample: dict[str, Any], item: dict[str, Any]) -> float:
        # No owner: a worker of its own, never one a job (or an earlier request) ran code in.
        result = await sandbox.call(source, "grade", [sample, item])
        if result.failure is not None:
            raise PythonGraderFailed(failure_text("grade", result))
        score = reward_value(result.value, "grade")
        if score.error is not None:
            raise PythonGraderFailed(score.error)
        return score.value

    return run


class JobReward:
    """The reward of one job, plus the other user functions its module may define (next_turn, tools)."""

    def __init__(self, reward: Reward, sandbox: Sandbox, judge: Judge | None, scorer: Scorer | None = None,
                 compute: Compute | None = None, *, owner: str | None = None) -> None:
        self.reward = reward
        self._sandbox = sandbox
        self._owner = owner  # the job: its sandbox workers are its own
        self._judge = judge
        self._scorer = scorer
        self._compute = compute  # where the text graders' work runs (None: inline)
        self._grader = parse_grader(reward.grader) if isinstance(reward, GraderReward) else None

    @property
    def functions(self) -> frozenset[str]:
        return frozenset(self.reward.functions)

    @property
    def _source(self) -> str | None:
        return self.reward.source

    async def score(self, completion: list[dict[str, Any]], item: Mapping[str, Any]) -> Score:
        """`completion`: the assistant's messages of the episode (and the tool results between them)."""
        reward = self.reward
        if isinstance(reward, PythonReward):
            if reward.entry == "grade":  # OpenAI's python grader: grade(sample, item)
                result = await self._sandbox.call(reward.source, "grade", [sample_of(completion), dict(item)],
                                                  owner=self._owner)
            else:  # MotteRL: reward_fn(completion, **row), completion = the assistant's messages
                assistant = [m for m in completion if m.get("role") == "assistant"]
                result = await self._sandbox.call(reward.source, reward.entry, [assistant], dict(item),
                                                  owner=self._owner)
            if result.failure is not None:
                return Score(0.0, failure_text(reward.entry, result))
            return reward_value(result.value, reward.entry)
        assert self._grader is not None
        try:
            graded = await grade_async(self._grader, sample_of(completion), dict(item), judge=self._judge,
                                       python=self._run_python_grader, scorer=self._scorer, compute=self._compute)
        except (GraderTimedOut, GraderInputTooLarge) as error:
            return Score(0.0, f"grader: {error}")
        if graded.error is not None:
            return Score(0.0, f"grader {graded.name}: {graded.error.kind}: {graded.error.message}")
        return Score(graded.score)

    async def _run_python_grader(self, grader: PythonGrader, sample: dict[str, Any], item: Mapping[str, Any]) -> float:
        result = await self._sandbox.call(grader.source, "grade", [sample, dict(item)], owner=self._owner)
        if result.failure is not None:
            raise PythonGraderFailed(failure_text(f"python grader {grader.name!r}", result))
        score = reward_value(result.value, "grade")
        if score.error is not None:
            raise PythonGraderFailed(score.error)
        return score.value

    async def next_turn(self, messages: list[dict[str, Any]], item: Mapping[str, Any]) -> str | None:
        """The next user message of a multi-step episode, or None to end it (also when next_turn fails)."""
        if self._source is None or "next_turn" not in self.functions:
            return None
        result = await self._sandbox.call(self._source, "next_turn", [messages], dict(item), owner=self._owner)
        if result.failure is not None:
            raise UserFunctionFailed(failure_text("next_turn", result))
        if result.value is None:
            return None
        if not isinstance(result.value, str):
            raise UserFunctionFailed(f"next_turn returned {type(result.value).__name__}, not a str or None")
        return result.value

    def has_tool(self, name: str) -> bool:
        scoring = self.reward.entry if isinstance(self.reward, PythonReward) else None
        return self._source is not None and name in self.functions and not name.startswith("_") \
            and name not in {scoring, "next_turn"}

    async def call_tool(self, name: str, arguments: str) -> str:
        """A tool call's result as the tool message's text; a bad call is reported to the model as text."""
        if not self.has_tool(name):
            return f"error: no tool named {name!r}"
        try:
            kwargs = orjson.loads(arguments or "{}")
        except orjson.JSONDecodeError as error:
            return f"error: the arguments are not JSON: {error}"
        if not isinstance(kwargs, dict):
            return "error: the arguments must be a JSON object"
        assert self._source is not None
        result = await self._sandbox.call(self._source, name, [], kwargs, owner=self._owner)
        if result.failure is not None:
            return f"error: {result.failure.kind}: {result.failure.message}"
        return result.value if isinstance(result.value, str) else orjson.dumps(result.value).decode()


class UserFunctionFailed(Exception):
    """next_turn failed: the episode ends and the sample scores 0 with this reason."""

