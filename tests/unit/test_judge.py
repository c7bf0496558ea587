"""`art.judge_group` / `art.judge_groups` (RULER-style relative judging) against a fake OpenAI-compatible judge
served in-process through `httpx.MockTransport`: the prompt, the JSON-schema request and its text fallback,
robust parsing, typed failures (drop / keep / raise), `independent_reward`, the memory and disk caches, the
concurrency cap, and recorded trajectories read from the server's view. The real engine as judge:
tests/integration/test_judge.py."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

import artlike as art
from artlike._judge import build_prompt, parse_scores, render_message

TRAJECTORY = re.compile(r'<trajectory id="(\d+)">\n(.*?)\n</trajectory>', re.DOTALL)
TASK = [{"role": "system", "content": "You answer geography questions."},
        {"role": "user", "content": "What is the capital of France?"}]


def offline(answer: str, reward: float | None = None) -> art.Trajectory:
    return art.Trajectory([*TASK, {"role": "assistant", "content": answer}], reward=reward)


def paris_scores(body: dict[str, Any]) -> str:
    """A judge that likes answers naming Paris: 1.0 for those, 0.2 for the rest."""
    trajectories = TRAJECTORY.findall(body["messages"][1]["content"])
    return json.dumps({"scores": [
        {"trajectory_id": number, "explanation": f"trajectory {number}", "score": 1.0 if "Paris" in text else 0.2}
        for number, text in trajectories]})


class FakeJudge:
    """An OpenAI-compatible chat completions endpoint: records every request, answers with `answer(body)`,
    optionally refuses `response_format` json_schema (400) or fails with `status`."""

    def __init__(self, answer: Callable[[dict[str, Any]], str] = paris_scores, *, reject_schema: bool = False,
                 status: int | None = None, delay: float = 0.0, finish_reason: str = "stop") -> None:
        self.answer, self.reject_schema, self.status, self.delay = answer, reject_schema, status, delay
        self.finish_reason = finish_reason
        self.requests: list[dict[str, Any]] = []
        self.in_flight = self.max_in_flight = 0

    async def handle(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/chat/completions"
        body = orjson.loads(request.content)
        self.requests.append(body)
        if self.status is not None:
            return httpx.Response(self.status, json={"error": {"message": "nope", "type": "x", "code": None}})
        if self.reject_schema and (body.get("response_format") or {}).get("type") == "json_schema":
            return httpx.Response(400, json={"error": {"message": "response_format json_schema is not supported",
                                                       "type": "invalid_request_error", "code": None}})
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(self.delay)
        self.in_flight -= 1
        return httpx.Response(200, json={
            "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": body["model"],
            "choices": [{"index": 0, "finish_reason": self.finish_reason,
                         "message": {"role": "assistant", "content": self.answer(body)}}]})

    def judge(self, **options: Any) -> art.Judge:
        client = openai.AsyncOpenAI(base_url="http://judge.test/v1", api_key="k", max_retries=0,
                                    http_client=httpx.AsyncClient(  # type: ignore[arg-type]  # openai types httpx2's
                                        transport=httpx.MockTransport(self.handle)))
        return art.Judge(model="judge-model", client=client, **options)


# ---------------------------------------------------------------------------------------------- prompt


def test_the_prompt_shows_the_task_once_each_distinct_conversation_numbered_and_the_rubric() -> None:
    conversations = [offline("Paris.").messages(), offline("Lyon?").messages(), offline("Paris.").messages()]
    conversations[1][-1]["token_ids"] = [1, 2, 3]  # wire fields never reach the judge
    prompt = build_prompt(conversations, "- Naming the right city is all that matters.")
    system, user = (message["content"] for message in prompt.messages)
    assert "Naming the right city is all that matters." in system and '"trajectory_id": "1"' in system
    assert user.count("What is the capital of France?") == 1 and user.startswith("<task>\n[system]\n")
    assert TRAJECTORY.findall(user) == [("1", "[assistant]\nParis."), ("2", "[assistant]\nLyon?")]
    assert "token_ids" not in user and "[1, 2, 3]" not in user
    assert (prompt.count, prompt.slots) == (2, [0, 1, 0])  # the identical third is judged once, with the first
    assert art.Judge.DEFAULT_RUBRIC in build_prompt(conversations).messages[0]["content"]


def test_tool_calls_and_results_are_shown_and_a_lone_conversation_still_gets_its_task() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"q": "France"}'}}
    conversation: list[dict[str, Any]] = [*TASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "Paris"}]},
                    {"role": "assistant", "content": "Paris."}]
    user = build_prompt([conversation, conversation]).messages[1]["content"]
    assert "<task>" in user and TRAJECTORY.findall(user) == [(
        "1", '[assistant]\n-> calls search({"q": "France"})\n\n[tool result for c1]\nParis\n\n[assistant]\nParis.')]
    assert render_message({"type": "function_call", "name": "f", "arguments": "{}"}).startswith("[function_call")


# ---------------------------------------------------------------------------------------- parsing


def test_parsing_is_robust_to_prose_fences_thinking_and_order() -> None:
    answer = ('<think>{"not": "this"}</think>Here you go:\n```json\n{"scores": [{"trajectory_id": 2, '
              '"explanation": "meh", "score": "0.25"}, {"trajectory_id": " 1", "score": 1}]}\n```')
    scores = parse_scores(answer, 2)
    assert [(s.trajectory_id.strip(), s.score, s.explanation) for s in scores] == [("1", 1.0, ""), ("2", 0.25, "meh")]


@pytest.mark.parametrize(("answer", "finish_reason", "message"), [
    ('{"scores": [{"trajectory_id": "1", "score": 1}]}', "stop", "expected each of ['1', '2'] once"),
    ('{"scores": [{"trajectory_id": "1", "score": 1}, {"trajectory_id": "1", "score": 0}]}', "stop", "once"),
    ('{"scores": [{"trajectory_id": "1", "score": 1}, {"trajectory_id": "2", "score": 7}]}', "stop", "outside [0, 1]"),
    ("Trajectory 1 is better.", "stop", "not the JSON asked for"),
    ('{"scores": [{"trajectory_id": "1", "expl', "length", "cut off at max_tokens"),
    ("", "stop", "not the JSON asked for"),
])
def test_a_wrong_answer_is_an_invalid_output_judge_error(answer: str, finish_reason: str, message: str) -> None:
    with pytest.raises(art.JudgeError, match=re.escape(message)) as raised:
        parse_scores(answer, 2, finish_reason=finish_reason)
    assert (raised.value.code, raised.value.raw, raised.value.retryable) == ("invalid_output", answer, True)
    assert isinstance(raised.value, art.ArtlikeError)


# -------------------------------------------------------------------------------------- judge_group


async def test_rewards_become_the_judge_scores_and_the_earlier_rewards_are_kept() -> None:
    fake = FakeJudge()
    group = art.TrajectoryGroup([offline("Paris.", reward=0.0), offline("Lyon.", reward=1.0), offline("Paris.")])
    judged = await art.judge_group(group, fake.judge())
    assert judged.rewards == [1.0, 0.2, 1.0]
    assert [t.metrics.get("independent_reward") for t in judged] == [0.0, 1.0, None]
    first = judged.trajectories[0]
    assert first.metadata == {"judge_model": "judge-model", "judge_score": 1.0, "judge_explanation": "trajectory 1",
                              "judge_cached": False}
    assert group.rewards == [0.0, 1.0, None] and group.trajectories[0].metadata == {}  # the input is untouched
    assert len(fake.requests) == 1 and len(TRAJECTORY.findall(fake.requests[0]["messages"][1]["content"])) == 2

    again = await art.judge_group(judged, fake.judge(cache_size=0))  # judging a judged group again
    assert [t.metrics.get("independent_reward") for t in again] == [0.0, 1.0, None]


async def test_the_request_asks_for_an_exact_json_schema_with_the_judges_parameters() -> None:
    fake = FakeJudge()
    judge = fake.judge(temperature=0.3, max_tokens=256, extra_body={"top_k": 5})
    await art.judge_group([offline("Paris."), offline("Lyon.")], judge)
    [body] = fake.requests
    assert (body["model"], body["temperature"], body["max_tokens"], body["top_k"]) == ("judge-model", 0.3, 256, 5)
    response_format = body["response_format"]
    assert response_format["type"] == "json_schema" and response_format["json_schema"]["strict"] is True
    scores = response_format["json_schema"]["schema"]["properties"]["scores"]
    assert (scores["minItems"], scores["maxItems"]) == (2, 2)
    entry = scores["items"]
    assert entry["properties"]["trajectory_id"]["enum"] == ["1", "2"]
    assert list(entry["properties"]) == ["trajectory_id", "explanation", "score"]  # reasons, then scores
    assert (entry["properties"]["score"]["minimum"], entry["properties"]["score"]["maximum"]) == (0, 1)
    assert "maxLength" not in entry["properties"]["explanation"]  # OpenAI's strict mode refuses it

    await art.judge_group([offline("Paris."), offline("Lyon.")], fake.judge(max_explanation_chars=80))
    schema = fake.requests[-1]["response_format"]["json_schema"]["schema"]
    assert schema["properties"]["scores"]["items"]["properties"]["explanation"]["maxLength"] == 80


async def test_structured_outputs_sends_the_schema_in_vllms_field_with_whitespace_off() -> None:
    fake = FakeJudge()
    judge = fake.judge(response_format="structured_outputs", max_explanation_chars=80, extra_body={"top_k": 5})
    judged = await art.judge_group([offline("Paris."), offline("Lyon.")], judge)
    [body] = fake.requests
    assert "response_format" not in body and body["top_k"] == 5  # vLLM refuses both constraints at once
    structured = body["structured_outputs"]
    assert structured["disable_any_whitespace"] is True
    scores = structured["json"]["properties"]["scores"]
    assert (scores["minItems"], scores["maxItems"]) == (2, 2)
    assert scores["items"]["properties"]["explanation"]["maxLength"] == 80
    assert judged.rewards == [1.0, 0.2]
    with pytest.raises(ValueError, match="structured_outputs"):
        fake.judge(response_format="xml")  # type: ignore[arg-type]


async def test_a_judge_that_rejects_the_schema_is_asked_for_json_in_text_from_then_on(
        caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeJudge(lambda body: "Sure!\n```json\n" + paris_scores(body) + "\n```", reject_schema=True)
    judge = fake.judge()
    with caplog.at_level(logging.WARNING, logger="artlike"):
        judged = await art.judge_group([offline("Paris."), offline("Lyon.")], judge)
    assert judged.rewards == [1.0, 0.2]
    assert [body.get("response_format", {}).get("type") for body in fake.requests] == ["json_schema", None]
    assert "rejected response_format json_schema" in caplog.text
    await art.judge_group([offline("Paris!"), offline("Rome.")], judge)
    assert "response_format" not in fake.requests[-1] and len(fake.requests) == 3  # no second refusal

    strict = FakeJudge(reject_schema=True)
    with pytest.raises(art.JudgeError) as raised:  # "json_schema" asked for explicitly: no fallback
        await art.judge_group([offline("Paris.")], strict.judge(response_format="json_schema"), retries=3)
    assert (raised.value.code, raised.value.retryable, len(strict.requests)) == ("api_error", False, 1)
    json_mode = FakeJudge()
    await art.judge_group([offline("Paris.")], json_mode.judge(response_format="json_object"))
    assert json_mode.requests[0]["response_format"] == {"type": "json_object"}


async def test_a_wrong_number_of_scores_fails_the_group_after_its_retries() -> None:
    fake = FakeJudge(lambda body: '{"scores": [{"trajectory_id": "1", "explanation": "x", "score": 1}]}')
    group = [offline("Paris."), offline("Lyon."), offline("Rome.")]
    with pytest.raises(art.JudgeError, match="expected each of") as raised:
        await art.judge_group(group, fake.judge(), retries=2)
    assert (raised.value.code, raised.value.attempts, len(fake.requests)) == ("invalid_output", 3, 3)
    assert "3 attempts" in str(raised.value)
    assert await art.judge_group(group, fake.judge(), retries=0, swallow_exceptions=True) is None
    assert len(fake.requests) == 4  # a failed answer is never cached


async def test_api_errors_are_retried_and_a_judge_that_cannot_be_used_always_raises() -> None:
    broken = FakeJudge(status=500)
    with pytest.raises(art.JudgeError, match=r"failed \(500\)") as raised:
        await art.judge_group([offline("Paris.")], broken.judge(), retries=1)
    assert (raised.value.code, len(broken.requests)) == ("api_error", 2)
    assert isinstance(raised.value.__cause__, openai.InternalServerError)

    unauthorized = FakeJudge(status=401)
    with pytest.raises(art.JudgeError) as raised:
        await art.judge_group([offline("Paris.")], unauthorized.judge(), swallow_exceptions=True)
    assert (raised.value.code, len(unauthorized.requests)) == ("judge_unavailable", 1)
    with pytest.raises(art.JudgeError, match="cannot be used"):
        await art.judge_groups([art.TrajectoryGroup([offline("Paris.")])], unauthorized.judge(), progress=False)


async def test_failed_trajectories_are_not_judged_and_pending_rollouts_are_refused() -> None:
    fake = FakeJudge()
    failed = offline("Paris?")
    failed.exception = RuntimeError("the agent crashed")
    judged = await art.judge_group(art.TrajectoryGroup([offline("Paris."), failed, offline("Lyon.")]), fake.judge())
    assert judged.rewards == [1.0, 0.2] and judged.exceptions == [failed.exception]

    async def rollout() -> art.Trajectory:
        return offline("Paris.")

    pending = rollout()
    with pytest.raises(ValueError, match="gather_trajectory_groups"):
        await art.judge_group(art.TrajectoryGroup([pending]), fake.judge())
    pending.close()
    assert (await art.judge_group([], fake.judge())).trajectories == [] and len(fake.requests) == 1


# --------------------------------------------------------------------------------------- judge_groups


def bad_for_rome(body: dict[str, Any]) -> str:
    return "no idea" if "Rome" in body["messages"][1]["content"] else paris_scores(body)


def three_groups() -> list[art.TrajectoryGroup]:
    return [art.TrajectoryGroup([offline("Paris.", 0.5), offline(answer, 0.5)]) for answer in ("Lyon.", "Rome.", "Nice.")]


async def test_groups_whose_judging_failed_are_dropped_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeJudge(bad_for_rome)
    with caplog.at_level(logging.WARNING, logger="artlike"):
        judged = await art.judge_groups(three_groups(), fake.judge(), retries=1, progress=False)
    assert [group.rewards for group in judged] == [[1.0, 0.2], [1.0, 0.2]]
    assert [group.trajectories[1].messages()[-1]["content"] for group in judged] == ["Lyon.", "Nice."]  # in order
    assert "judging failed for 1 of 3 groups (dropped): group 1:" in caplog.text
    assert len(fake.requests) == 4  # the failing group was asked twice


async def test_keep_leaves_a_failed_groups_rewards_and_raise_raises() -> None:
    fake = FakeJudge(bad_for_rome)
    kept = await art.judge_groups(three_groups(), fake.judge(), on_failure="keep", retries=0, progress=False)
    assert [group.rewards for group in kept] == [[1.0, 0.2], [0.5, 0.5], [1.0, 0.2]]
    assert "not the JSON asked for" in kept[1].trajectories[0].metadata["judge_error"]
    assert "independent_reward" not in kept[1].trajectories[0].metrics
    with pytest.raises(art.JudgeError, match="not the JSON asked for"):
        await art.judge_groups(three_groups(), fake.judge(), on_failure="raise", retries=0, progress=False)
    with pytest.raises(ValueError, match="on_failure"):
        await art.judge_groups(three_groups(), fake.judge(), on_failure="ignore", progress=False)  # type: ignore[arg-type]


async def test_concurrency_caps_the_judge_requests_in_flight() -> None:
    fake = FakeJudge(delay=0.02)
    groups = [art.TrajectoryGroup([offline("Paris."), offline(f"Lyon {n}.")]) for n in range(6)]
    judged = await art.judge_groups(groups, fake.judge(), concurrency=2, progress=False)
    assert len(judged) == 6 and fake.max_in_flight == 2
    assert [group.trajectories[1].messages()[-1]["content"] for group in judged] == [f"Lyon {n}." for n in range(6)]


# ---------------------------------------------------------------------------------------------- cache


async def test_a_repeated_request_is_answered_from_the_cache_without_a_second_request(tmp_path: Path) -> None:
    fake = FakeJudge()
    judge = fake.judge(cache_dir=tmp_path)
    group = [offline("Paris.", 0.0), offline("Lyon.", 1.0)]
    first = await art.judge_group(group, judge)
    second = await art.judge_group(group, judge)
    assert len(fake.requests) == 1
    assert second.rewards == first.rewards == [1.0, 0.2]
    assert [t.metadata["judge_cached"] for t in (*first, *second)] == [False, False, True, True]
    assert [t.metrics["independent_reward"] for t in second] == [0.0, 1.0]
    await art.judge_group(group, judge, cache=False)  # bypasses it
    await art.judge_group(group, fake.judge(cache_dir=tmp_path, temperature=0.7))  # other sampling: a new request
    await art.judge_group(group, judge, rubric="- Only brevity counts.")  # another prompt: another request
    assert len(fake.requests) == 4
    prompt = build_prompt([m.messages() for m in group])
    keys = {fake.judge(**options).cache_key(prompt.messages, prompt.count) for options in (
        {}, {"max_tokens": 9}, {"max_explanation_chars": 9}, {"extra_body": {"top_k": 1}}, {"response_format": "text"})}
    assert len(keys) == 4  # every option that changes the answer is in the key; the format is not


async def test_the_disk_cache_is_shared_by_judges_and_survives_a_broken_file(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeJudge()
    group = [offline("Paris."), offline("Lyon.")]
    await art.judge_group(group, fake.judge(cache_dir=tmp_path))
    [stored] = cache_files(tmp_path)
    assert len(stored.stem) == 64 and stored.suffix == ".json"  # sha256 names, no temporary leftovers

    again = await art.judge_group(group, fake.judge(cache_dir=tmp_path))  # a new judge: a new memory LRU
    assert len(fake.requests) == 1 and again.rewards == [1.0, 0.2] and again.trajectories[0].metadata["judge_cached"]

    stored.write_text("{ broken")
    with caplog.at_level(logging.WARNING, logger="artlike"):
        repaired = await art.judge_group(group, fake.judge(cache_dir=tmp_path))
    assert len(fake.requests) == 2 and repaired.rewards == [1.0, 0.2] and "unreadable judge cache" in caplog.text
    assert orjson.loads(stored.read_bytes())["scores"][0]["score"] == 1.0  # rewritten


def cache_files(directory: Path) -> list[Path]:
    return sorted(directory.iterdir())


# ------------------------------------------------------------------------------- recorded trajectories


async def test_a_recorded_trajectory_is_judged_on_its_last_completion_as_the_server_shows_it() -> None:
    def view(trajectory_id: str, answer: str) -> dict[str, Any]:
        def completion(id: int, messages: list[dict[str, Any]], content: str) -> dict[str, Any]:
            return {"id": id, "model": "agent", "served_model": "agent@0", "step": 0, "created_at": 1.0,
                    "finish_reason": "stop", "messages": messages, "response": {"content": content}, "tokens": []}
        return {"trajectory_id": trajectory_id, "completions": [
            completion(2, [*TASK, {"role": "assistant", "content": "Let me think."},
                           {"role": "user", "content": "Well?"}], answer),
            completion(1, TASK, "Let me think.")]}

    answers: dict[str, str] = {}

    def server(request: httpx.Request) -> httpx.Response:
        trajectory_id = request.url.path.split("/")[3]
        if trajectory_id not in answers:
            return httpx.Response(404, json={"error": {"message": "no completions", "code": "trajectory_not_found"}})
        assert request.url.path.endswith("/view")
        return httpx.Response(200, json=view(trajectory_id, answers[trajectory_id]))

    model = art.TrainableModel("agent", "base/model", "http://artlike.test", transport=httpx.MockTransport(server))
    trajectories = []
    for answer in ("Paris.", "Lyon."):
        async with model.trajectory() as t:
            answers[t.id] = answer
            t.reward = 0.5
        trajectories.append(t)
    fake = FakeJudge()
    judged = await art.judge_group(trajectories, fake.judge())
    assert judged.rewards == [1.0, 0.2] and judged.trajectories[0].id == trajectories[0].id
    user = fake.requests[0]["messages"][1]["content"]
    assert TRAJECTORY.findall(user)[0] == ("1", "[assistant]\nLet me think.\n\n[user]\nWell?\n\n[assistant]\nParis.")

    async with model.trajectory() as unseen:  # made no completion: the server has nothing to show
        pass
    with pytest.raises(art.JudgeError) as raised:
        await art.judge_group([trajectories[0], unseen], fake.judge())
    assert raised.value.code == "trajectory_unavailable" and isinstance(raised.value.__cause__, art.NotFoundError)


# ------------------------------------------------------------------------------------------ sync twins


def test_the_sync_twins() -> None:
    fake = FakeJudge()
    judge = fake.judge()
    judged = art.judge_group_sync([offline("Paris."), offline("Lyon.")], judge)
    assert judged.rewards == [1.0, 0.2]
    [group] = art.judge_groups_sync([art.TrajectoryGroup([offline("Paris."), offline("Lyon.")])], judge, progress=False)
    assert group.rewards == [1.0, 0.2] and len(fake.requests) == 1  # the second call: a cache hit


def test_judge_options_are_checked() -> None:
    with pytest.raises(ValueError, match="response_format"):
        art.Judge(model="m", response_format="yaml")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="uses that client as is"):
        art.Judge(model="m", base_url="http://x/v1", client=openai.AsyncOpenAI(api_key="k"))
    assert "api_key" not in repr(art.Judge(model="m", api_key="secret")) and "secret" not in repr(
        art.Judge(model="m", api_key="secret"))
