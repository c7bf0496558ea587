"""The `reward_model` grader: what conversation it scores, the injected scorer (sync, async, missing, failing),
inside multi graders, and the server's scorer (`ServerScorer`, an HTTP client of `/v1/rewards`) with the job
reward and graders/run services around it. No engine or trainer: the scorer is a stand-in."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from artlike_server.jobs.graders_service import GraderService
from artlike_server.jobs.intake import check_grade_source, grader_reward
from artlike_server.jobs.rewards import JobReward, ServerScorer
from artlike_server.jobs.sandbox import Sandbox
from pydantic import ValidationError

from artlike.graders import (
    GraderNotRunnableHere,
    RewardModelGrader,
    ScorerUnavailable,
    grade,
    grade_async,
    parse_grader,
)

RM = {"type": "reward_model", "name": "rm", "model": "helpful-rm"}
CHAT_ITEM = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
             "reference_answer": "4"}


class FakeScorer:
    """Scores by a table of answers (the last message's content); records what it was asked."""

    def __init__(self, scores: dict[str, float] | None = None) -> None:
        self.scores = scores or {}
        self.calls: list[tuple[list[dict[str, Any]], str]] = []

    def __call__(self, messages: list[dict[str, Any]], model: str) -> float:
        self.calls.append((messages, model))
        return self.scores.get(messages[-1]["content"], 0.0)


# ------------------------------------------------------------------------------------- what it scores


def test_scores_the_items_messages_then_the_sample_as_the_answer() -> None:
    scorer = FakeScorer({"4": 2.5})
    result = grade(RM, "4", CHAT_ITEM, scorer=scorer)
    assert (result.name, result.type, result.score, result.passed, result.error) == ("rm", "reward_model", 2.5,
                                                                                   None, None)
    (messages, model), = scorer.calls
    assert model == "helpful-rm"
    assert messages == [*CHAT_ITEM["messages"], {"role": "assistant", "content": "4"}]


def test_a_motterl_prompt_is_one_user_message_and_tool_calls_ride_along() -> None:
    scorer = FakeScorer()
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    grade(RM, {"output_text": "", "output_tools": [call]}, {"prompt": "Add 2 and 2."}, scorer=scorer)
    (messages, _), = scorer.calls
    assert messages == [{"role": "user", "content": "Add 2 and 2."},
                        {"role": "assistant", "content": "", "tool_calls": [call]}]


def test_input_templates_replace_the_items_prompt() -> None:
    scorer = FakeScorer()
    grader = {**RM, "input": [{"role": "user", "content": "Question: {{item.question}}"}]}
    grade(grader, "Paris", {"question": "Capital of France?", "messages": "ignored"}, scorer=scorer)
    (messages, _), = scorer.calls
    assert messages == [{"role": "user", "content": "Question: Capital of France?"},
                        {"role": "assistant", "content": "Paris"}]


def test_the_score_is_the_models_own_scale_and_pass_threshold_applies() -> None:
    scorer = FakeScorer({"good": 3.75, "bad": -1.5})
    grader = {**RM, "pass_threshold": 0.0}
    assert grade(grader, "good", CHAT_ITEM, scorer=scorer).model_dump(include={"score", "passed"}) == \
        {"score": 3.75, "passed": True}
    assert grade(grader, "bad", CHAT_ITEM, scorer=scorer).model_dump(include={"score", "passed"}) == \
        {"score": -1.5, "passed": False}


def test_an_item_without_a_prompt_is_a_per_sample_error() -> None:
    scorer = FakeScorer()
    result = grade(RM, "4", {"reference_answer": "4"}, scorer=scorer)
    assert result.score == 0.0 and result.error is not None and result.error.kind == "invalid_variable_error"
    assert "input" in result.error.message and scorer.calls == []
    bad = grade(RM, "4", {"messages": ["not a message"]}, scorer=scorer)
    assert bad.error is not None and bad.error.kind == "invalid_variable_error"


def test_the_model_is_a_reward_model_reference() -> None:
    assert isinstance(parse_grader({**RM, "model": "rm@12"}), RewardModelGrader)
    for bad in ("rm@x", "", "a/b"):
        with pytest.raises(ValidationError, match="model"):
            parse_grader({**RM, "model": bad})
    with pytest.raises(ValidationError):
        parse_grader({**RM, "range": [0, 1]})  # not a score_model: no range


# ---------------------------------------------------------------------------------------- the scorer


def test_without_a_scorer_it_says_what_it_needs() -> None:
    with pytest.raises(GraderNotRunnableHere, match="scorer"):
        grade(RM, "4", CHAT_ITEM)
    with pytest.raises(GraderNotRunnableHere, match="scorer"):  # also inside a multi grader
        grade({"type": "multi", "graders": {"r": RM}, "calculate_output": "r"}, "4", CHAT_ITEM,
              judge=lambda m, model: "1")


def test_an_async_scorer_needs_grade_async() -> None:
    async def scorer(messages: list[dict[str, Any]], model: str) -> float:
        await asyncio.sleep(0)
        return 0.5

    with pytest.raises(TypeError, match="grade_async"):
        grade(RM, "4", CHAT_ITEM, scorer=scorer)
    assert asyncio.run(grade_async(RM, "4", CHAT_ITEM, scorer=scorer)).score == 0.5


def test_a_scorer_that_cannot_score_fails_the_sample_not_the_caller() -> None:
    def unavailable(messages: list[dict[str, Any]], model: str) -> float:
        raise ScorerUnavailable(f"the reward model {model!r} answered 404: no such model")

    result = grade(RM, "4", CHAT_ITEM, scorer=unavailable)
    assert result.score == 0.0 and result.error is not None
    assert (result.error.kind, result.error.message) == ("model_grader_server_error",
                                                         "the reward model 'helpful-rm' answered 404: no such model")
    nan = grade(RM, "4", CHAT_ITEM, scorer=lambda m, model: math.nan)
    assert nan.error is not None and nan.error.kind == "model_grader_parse_error"
    with pytest.raises(TypeError, match="number"):  # a scorer that returns text is a bug of the caller's
        grade(RM, "4", CHAT_ITEM, scorer=lambda m, model: "0.5")  # type: ignore[arg-type,return-value]


def test_inside_a_multi_grader_and_reward_components() -> None:
    scorer = FakeScorer({"4": 0.8, "5": 0.1})
    multi = {"type": "multi", "name": "m", "calculate_output": "0.5 * rm + 0.5 * exact", "graders": {
        "rm": RM, "exact": {"type": "string_check", "name": "exact", "input": "{{sample.output_text}}",
                            "reference": "{{item.reference_answer}}", "operation": "eq"}}}
    right = grade(multi, "4", CHAT_ITEM, scorer=scorer)
    assert right.score == pytest.approx(0.9) and right.sub_scores == {"rm": 0.8, "exact": 1.0}
    assert grade(multi, "5", CHAT_ITEM, scorer=scorer).score == pytest.approx(0.05)
    listed = {**multi, "graders": [RM, {"type": "format"}], "calculate_output": "rm + format"}
    assert grade(listed, "4", CHAT_ITEM, scorer=scorer).sub_scores == {"rm": 0.8, "format": 0.0}
    components = {"format_reward_weight": 0.0, "extract_answer": False, "graders": [RM]}
    assert grade(components, "4", CHAT_ITEM, scorer=scorer).score == pytest.approx(0.8)

    def down(messages: list[dict[str, Any]], model: str) -> float:
        raise ScorerUnavailable("the trainer is not available")

    failed = grade(multi, "4", CHAT_ITEM, scorer=down)
    assert failed.score == 0.0 and failed.error is not None
    assert failed.error.kind == "model_grader_server_error" and failed.error.message.startswith("rm: ")


# ------------------------------------------------------------------------------- the server's scorer


def rewards_server(seen: list[httpx.Request], status: int = 200) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if status != 200:
            return httpx.Response(status, json={"error": {"message": "model 'helpful-rm' is not registered",
                                                          "type": "not_found_error", "param": "model",
                                                          "code": "model_not_found"}})
        body = orjson.loads(request.content)
        return httpx.Response(200, json={"object": "list", "model": f"{body['model']}@3", "data": [
            {"index": 0, "score": 1.25, "objectives": {"o0": 1.25}, "tokens": 17}]})

    return httpx.MockTransport(handle)


async def test_server_scorer_posts_one_conversation_to_v1_rewards() -> None:
    seen: list[httpx.Request] = []
    scorer = ServerScorer("http://self.test", "key", transport=rewards_server(seen))
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    assert await scorer(messages, "helpful-rm") == 1.25
    await scorer.aclose()
    (request,) = seen
    assert (request.method, request.url.path, request.headers["authorization"]) == ("POST", "/v1/rewards",
                                                                                    "Bearer key")
    assert orjson.loads(request.content) == {"model": "helpful-rm", "inputs": [messages]}


async def test_server_scorer_errors_are_scorer_unavailable() -> None:
    scorer = ServerScorer("http://self.test", None, transport=rewards_server([], status=404))
    with pytest.raises(ScorerUnavailable, match="answered 404: model 'helpful-rm' is not registered"):
        await scorer([{"role": "assistant", "content": "x"}], "helpful-rm")
    await scorer.aclose()

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    offline = ServerScorer("http://self.test", None, transport=httpx.MockTransport(refuse))
    with pytest.raises(ScorerUnavailable, match="did not answer: ConnectError"):
        await offline([{"role": "assistant", "content": "x"}], "helpful-rm")
    await offline.aclose()


async def test_a_jobs_grader_reward_and_graders_run_use_the_scorer(tmp_path: Path) -> None:
    seen: list[httpx.Request] = []
    scorer = ServerScorer("http://self.test", None, transport=rewards_server(seen))
    reward = JobReward(grader_reward(RM, param="grader"), Sandbox(tmp_path / "sandbox"), judge=None, scorer=scorer)
    completion = [{"role": "assistant", "content": "4"}]
    score = await reward.score(completion, CHAT_ITEM)
    assert (score.value, score.error) == (1.25, None)
    assert orjson.loads(seen[0].content)["inputs"] == [[*CHAT_ITEM["messages"], *completion]]
    unscored = JobReward(grader_reward(RM, param="grader"), Sandbox(tmp_path / "sandbox"), judge=None)
    with pytest.raises(GraderNotRunnableHere):  # a server always wires one: without it is a bug, not a 0
        await unscored.score(completion, CHAT_ITEM)

    async def no_python(source: str, sample: dict[str, Any], item: dict[str, Any]) -> float:
        raise AssertionError("no python grader here")

    service = GraderService(no_python, None, check_source=check_grade_source, scorer=scorer)
    answer = await service.run({**RM, "pass_threshold": 1.0}, "4", CHAT_ITEM)
    assert answer["reward"] == 1.25 and not any(v for v in answer["metadata"]["errors"].values() if v is True)
    missing = ServerScorer("http://self.test", None, transport=rewards_server([], status=404))
    failing = GraderService(no_python, None, check_source=check_grade_source, scorer=missing)
    answer = await failing.run(RM, "4", CHAT_ITEM)
    errors = answer["metadata"]["errors"]
    assert answer["reward"] == 0.0 and errors["model_grader_server_error"] is True
    assert "not registered" in errors["model_grader_server_error_details"]
    await scorer.aclose()
    await missing.aclose()
