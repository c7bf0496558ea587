"""Managed jobs on the real server: MotteRL's API with its own payload and reward functions verbatim, the
official `openai` SDK's files + fine_tuning.jobs flow with SeekrFlow-style graders, multi-step episodes,
reward errors and timeouts (the server keeps serving) and bad requests. A restart in the middle of a job is in
test_restart.py."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import orjson
import pytest
from artlike_server.launcher import ServerProcess

from tests.openapi_schema import assert_valid

from .helpers import async_http_client, async_openai_client

pytestmark = pytest.mark.integration

# MotteRL's documentation, verbatim: its first reward function and its example payload.
MOTTERL_REWARD = """def reward_fn(completion, **kwargs):
    response = completion[0].get('content', '')
    expected = kwargs.get('expected_result', '')
    return 1.0 if expected in response else 0.0
"""
MOTTERL_MULTI_CRITERIA = """def multi_criteria_reward(completion, **kwargs):
    response = completion[0].get('content', '')

    # Accuracy score
    expected = kwargs.get('expected_result', '')
    accuracy = 1.0 if expected.lower() in response.lower() else 0.0

    # Length score (prefer concise responses)
    target_length = kwargs.get('target_length', 100)
    length_score = max(0, 1 - abs(len(response) - target_length) / target_length)

    # Sentiment score
    positive_words = ['good', 'great', 'excellent', 'helpful']
    sentiment_score = sum(1 for word in positive_words if word in response.lower()) / len(positive_words)

    # Weighted combination
    return 0.5 * accuracy + 0.3 * length_score + 0.2 * sentiment_score
"""
MOTTERL_ROWS = [{"prompt": "What is AI?", "expected_result": "Artificial Intelligence"},
                {"prompt": "Define ML", "expected_result": "Machine Learning"}]
MOTTERL_PAYLOAD = {
    "model": "qwen-2.5-7b",
    "learningRate": 0.01,
    "iterations": "100",
    "batchSize": 8,
    "multiStep": False,
    "rewardFunction": MOTTERL_REWARD,
    "trainingData": MOTTERL_ROWS,
}
SEEKR_SYSTEM = ("A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
                "The assistant first thinks about the reasoning process in the mind and then provides the user with "
                "the answer. The reasoning process and answer are enclosed within <think> </think> and <answer> "
                "</answer> tags, respectively, i.e., <think> reasoning process here </think><answer> answer here "
                "</answer>")


def seekr_row(question: str, answer: str) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": SEEKR_SYSTEM}, {"role": "user", "content": question}],
            "reference_answer": answer}


async def wait_for(async_http: httpx.AsyncClient, job_id: str, predicate: Any, limit_s: float = 420) -> dict[str, Any]:
    deadline = time.monotonic() + limit_s
    while True:
        job = (await async_http.get(f"/v1/fine_tuning/jobs/{job_id}")).json()
        if predicate(job):
            return job
        assert time.monotonic() < deadline, f"job {job_id} never got there: {job}"
        await asyncio.sleep(0.5)


async def events_of(async_http: httpx.AsyncClient, job_id: str) -> list[dict[str, Any]]:
    body = (await async_http.get(f"/v1/fine_tuning/jobs/{job_id}/events", params={"limit": 1000})).json()
    return list(reversed(body["data"]))  # oldest first


async def raw(server: ServerProcess, path: str) -> Any:
    """A response body as the server sent it (the SDK's objects fill fields it did not send with None)."""
    async with async_http_client(server, timeout=5) as client:
        response = await client.get(path)
    assert response.status_code == 200, response.text
    return response.json()


def without_method(job: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in job.items() if k != "method"}


def finished(job: dict[str, Any]) -> bool:
    return job["status"] in {"succeeded", "failed", "cancelled"}


async def test_motterl_example_payload_is_accepted_verbatim_and_cancels(async_http: httpx.AsyncClient, server: ServerProcess) -> None:
    started = await async_http.post("/api/training/start", json=MOTTERL_PAYLOAD)
    assert started.status_code == 200, started.text
    body = started.json()
    assert set(body) == {"job_id", "status"} and body["status"] in {"queued", "training"}
    job_id = body["job_id"]
    await wait_for(async_http, job_id, lambda j: j["status"] == "running")
    status = (await async_http.get(f"/api/training/status/{job_id}")).json()
    assert status["status"] == "training" and status["totalIterations"] == 100
    assert status["currentIteration"] == 0 and status["progress"] == 0.0
    assert set(status["metrics"]) == {"averageReward", "loss"}
    warnings = [e["message"] for e in await events_of(async_http, job_id) if e["level"] == "warn"]
    assert any("'qwen-2.5-7b' is not served here" in w for w in warnings), warnings
    assert any("learning rate 0.01 is outside" in w for w in warnings), warnings

    cancelled = await async_http.post(f"/api/training/cancel/{job_id}")
    assert cancelled.status_code == 200
    job = await wait_for(async_http, job_id, finished)
    assert job["status"] == "cancelled" and job["fine_tuned_model"] is None
    listed = (await async_http.get("/api/training/jobs")).json()["jobs"]
    assert any(j["job_id"] == job_id and j["status"] == "cancelled" for j in listed)
    again = await async_http.post(f"/api/training/cancel/{job_id}")
    assert again.status_code == 409 and again.json()["error"]["code"] == "job_finished"
    # The target model stays served at its last good step.
    model = job["artlike"]["target_model"]
    reply = await async_http.post("/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert reply.status_code == 200, reply.text


async def test_motterl_multi_criteria_job_runs_to_completion_with_followed_logs(async_http: httpx.AsyncClient) -> None:
    rows = [{**row, "target_length": 40} for row in MOTTERL_ROWS]
    started = await async_http.post("/api/training/start", json={
        "model": "phi-3.5-mini", "learningRate": 1e-4, "iterations": 2, "batchSize": 2, "multiStep": False,
        "rewardFunction": MOTTERL_MULTI_CRITERIA, "trainingData": rows, "groupSize": 2, "maxTokens": 16})
    assert started.status_code == 200, started.text
    job_id = started.json()["job_id"]

    lines: list[dict[str, Any]] = []
    async with async_http.stream("GET", f"/api/training/logs/{job_id}", params={"follow": "true"}) as stream:
        assert stream.headers["content-type"].startswith("application/x-ndjson")
        async for line in stream.aiter_lines():
            if line:
                lines.append(orjson.loads(line))
    final = lines[-1]
    assert final["object"] == "fine_tuning.job" and final["status"] == "succeeded", final
    events = lines[:-1]
    assert all(e["object"] == "fine_tuning.job.event" for e in events)
    metrics = [e["data"] for e in events if e["type"] == "metrics"]
    assert [m["iteration"] for m in metrics] == [1, 2]
    assert all(m["rollouts"] == 2 * 2 and m["reward_errors"] == 0 for m in metrics)  # batchSize × groupSize
    assert all(0.0 <= m["reward_mean"] <= 1.0 for m in metrics)

    status = (await async_http.get(f"/api/training/status/{job_id}")).json()
    assert status["status"] == "completed" and status["progress"] == 1.0 and status["currentIteration"] == 2
    assert status["metrics"]["averageReward"] == pytest.approx(metrics[-1]["reward_mean"])
    # Every committed step is a checkpoint and a step of the trained model.
    checkpoints = (await async_http.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints")).json()["data"]
    info = (await async_http.get(f"/v1/trainable_models/{final['fine_tuned_model']}")).json()
    assert len(checkpoints) == sum(1 for m in metrics if m["groups_trained"] > 0)
    assert info["latest_step"] == len(checkpoints)


async def test_openai_sdk_files_and_reinforcement_job_with_seekrflow_graders(server: ServerProcess) -> None:
    client = async_openai_client(server, max_retries=2)
    train = [seekr_row(f"What is {a} + {b}?", str(a + b)) for a, b in [(2, 3), (4, 4)]]
    validation = [seekr_row("What is 3 + 3?", "6"), seekr_row("What is 2 + 7?", "9")]
    training_file = await client.files.create(
        file=("math.jsonl", b"".join(orjson.dumps(r) + b"\n" for r in train)), purpose="fine-tune")
    validation_file = await client.files.create(
        file=("math-val.jsonl", b"".join(orjson.dumps(r) + b"\n" for r in validation)), purpose="fine-tune")
    grader = {"format_reward_weight": 0.2,
              "graders": [{"type": "math_accuracy", "weight": 0.5},
                          {"type": "string_check", "operation": "contains", "weight": 0.3,
                           "input": "{{sample.output_text}}", "reference": "{{item.reference_answer}}"}]}
    # artlike's hyperparameters (group_size, max_tokens, learning_rate) ride along in the same dict.
    hyperparameters = {"batch_size": 1, "n_epochs": 1, "eval_interval": 1, "group_size": 4, "max_tokens": 16,
                       "learning_rate": 5e-5}
    job = await client.fine_tuning.jobs.create(
        model=server.model_id, training_file=training_file.id, validation_file=validation_file.id, suffix="math",
        seed=7, metadata={"suite": "jobs"},
        method={"type": "reinforcement", "reinforcement": {"grader": grader,  # type: ignore[typeddict-item]
                                                           "hyperparameters": hyperparameters}})
    assert job.status in {"queued", "running"} and job.fine_tuned_model is None
    # SeekrFlow's RewardComponents is not one of the spec's graders: the rest of the job object is the spec's.
    assert_valid("FineTuningJob", without_method(await raw(server, f"/v1/fine_tuning/jobs/{job.id}")))
    assert job.method is not None and job.method.type == "reinforcement"

    deadline = time.monotonic() + 480
    while (job := await client.fine_tuning.jobs.retrieve(job.id)).status not in {"succeeded", "failed", "cancelled"}:
        assert time.monotonic() < deadline
        await asyncio.sleep(1)
    assert job.status == "succeeded", job.error
    assert job.fine_tuned_model and job.finished_at and job.trained_tokens is not None
    assert_valid("FineTuningJob", without_method(await raw(server, f"/v1/fine_tuning/jobs/{job.id}")))

    events = [e async for e in client.fine_tuning.jobs.list_events(job.id, limit=100)]
    assert_valid("ListFineTuningJobEventsResponse", await raw(server, f"/v1/fine_tuning/jobs/{job.id}/events?limit=100"))
    evaluations = [e.data for e in events if e.type == "metrics" and e.data and e.data.get("eval")]  # type: ignore[union-attr]
    assert sorted(e["iteration"] for e in evaluations) == [0, 1, 2]  # before, and after each of 2 iterations
    assert all(0.0 <= e["valid_pass_rate"] <= 1.0 and e["valid_samples"] == 2 for e in evaluations)
    checkpoints = (await client.fine_tuning.jobs.checkpoints.list(job.id)).data
    assert_valid("ListFineTuningJobCheckpointsResponse", await raw(server, f"/v1/fine_tuning/jobs/{job.id}/checkpoints"))
    for checkpoint in checkpoints:
        assert checkpoint.fine_tuned_model_checkpoint.startswith(f"{job.fine_tuned_model}@")
    listed = [j.id async for j in client.fine_tuning.jobs.list(metadata={"suite": "jobs"})]
    assert job.id in listed

    reply = await client.chat.completions.create(model=job.fine_tuned_model, max_tokens=8,
                                                 messages=[{"role": "user", "content": "What is 1 + 1?"}])
    assert reply.choices[0].message.content is not None
    await client.close()


async def test_multi_step_episodes_take_the_next_turn_from_the_reward_module(async_http: httpx.AsyncClient) -> None:
    source = (
        "def next_turn(messages, **kwargs):\n"
        "    users = [m for m in messages if m['role'] == 'user']\n"
        "    return 'Now say it in French.' if len(users) < 2 else None\n\n"
        "def reward_fn(completion, **kwargs):\n"
        "    assert all(m['role'] == 'assistant' for m in completion)\n"
        "    return float(len(completion))\n")
    started = await async_http.post("/api/training/start", json={
        "model": "llama-3.1-8b", "learningRate": 1e-5, "iterations": 1, "batchSize": 1, "multiStep": True,
        "rewardFunction": source, "trainingData": [{"prompt": "Say hello."}], "groupSize": 2, "maxTokens": 8})
    assert started.status_code == 200, started.text
    job = await wait_for(async_http, started.json()["job_id"], finished)
    assert job["status"] == "succeeded", job["error"]
    metrics = [e["data"] for e in await events_of(async_http, job["id"]) if e["type"] == "metrics"]
    # Two assistant turns per episode: the user turn next_turn gave was answered, then next_turn said stop.
    assert metrics[0]["reward_mean"] == 2.0 and metrics[0]["reward_errors"] == 0


async def test_reward_errors_are_reported_and_a_job_whose_rewards_all_fail_stops(
        async_http: httpx.AsyncClient, server: ServerProcess) -> None:
    source = ("def reward_fn(completion, **kwargs):\n"
              "    if kwargs['kind'] == 'bad':\n"
              "        return 1 / 0\n"
              "    if kwargs['kind'] == 'slow':\n"
              "        while True:\n"
              "            pass\n"
              "    return float('nan')\n")
    started = await async_http.post("/api/training/start", json={
        "model": server.model_id, "iterations": 3, "batchSize": 2, "rewardFunction": source, "groupSize": 2,
        "maxTokens": 4, "trainingData": [{"prompt": "Hi", "kind": "bad"}, {"prompt": "Yo", "kind": "slow"}]})
    assert started.status_code == 200, started.text
    job_id = started.json()["job_id"]
    await wait_for(async_http, job_id, lambda j: j["status"] == "running")
    # While the rewards loop forever in the sandbox, the server keeps serving.
    began = time.monotonic()
    reply = await async_http.post("/v1/chat/completions", json={
        "model": server.model_id, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert reply.status_code == 200 and time.monotonic() - began < 30
    assert (await async_http.get("/health")).status_code == 200

    job = await wait_for(async_http, job_id, finished)
    assert job["status"] == "failed"
    assert job["error"]["code"] == "reward_failed"
    assert "every reward of iteration 1 failed" in job["error"]["message"]
    warnings = [e["message"] for e in await events_of(async_http, job_id) if e["level"] == "warn"]
    reported = [w for w in warnings if w.startswith("reward error")]
    assert 1 <= len(reported) <= 3
    text = "\n".join(reported)
    assert ("ZeroDivisionError" in text and "line 3" in text) or "timeout" in text, text


async def test_a_job_against_a_flat_curve_samples_more_rows_and_follows_its_schedules(
        async_http: httpx.AsyncClient, server: ServerProcess) -> None:
    # A row with a fixed reward never carries signal; the other row's reward follows the answer's length.
    source = ("def reward_fn(completion, **kwargs):\n"
              "    if 'fixed' in kwargs:\n"
              "        return kwargs['fixed']\n"
              "    return len(completion[0].get('content', '')) / 100\n")
    started = await async_http.post("/api/training/start", json={
        "model": server.model_id, "iterations": 2, "batchSize": 2, "rewardFunction": source, "maxTokens": 8,
        "learningRate": 1e-4, "trainingData": [{"prompt": "Say something.", "fixed": 0.5},
                                               {"prompt": "Tell me a story."}],
        "dynamicSampling": {"max_resample_factor": 2}, "entropyCoef": 0.001, "epsilonHigh": 0.4,
        "clipCovFraction": 0.05, "positiveAdvantageWeight": 0.5,
        "entropyControl": {"target": 10.0, "coef_step": 0.002},  # any sampling entropy is under 10 nats a token
        "temperatureSchedule": {"start": 1.2, "end": 1.0, "steps": 1},
        "groupSizeSchedule": {"start": 3, "end": 4, "steps": 1},
        "learningRateSchedule": {"start": 1e-4, "end": 5e-5, "steps": 1}})
    assert started.status_code == 200, started.text
    job_id = started.json()["job_id"]
    job = await wait_for(async_http, job_id, finished)
    assert job["status"] == "succeeded", job["error"]
    metrics = [e["data"] for e in await events_of(async_http, job_id) if e["type"] == "metrics"]
    assert [(m["temperature"], m["group_size"]) for m in metrics] == [(1.2, 3), (1.0, 4)]
    assert [m["learning_rate"] for m in metrics] == pytest.approx([1e-4, 5e-5], rel=1e-9)
    # the entropy bonus starts at entropyCoef and rises by the control's step after an iteration under target
    assert [m["entropy_coef"] for m in metrics] == pytest.approx([0.001, 0.003], rel=1e-9)
    for m in metrics:
        # Every batch holds the fixed row, so each iteration drew more rows: until two groups differed, or
        # it had looked at twice the batch (the bound).
        assert 2 < m["groups"] <= 4 and m["rollouts"] == m["groups"] * m["group_size"], m
        assert m["groups_trained"] == 2 or m["groups"] == 4, m
        assert m["zero_variance_groups"] == m["groups"] - m["groups_trained"] >= 1, m
        assert m["groups_all_wrong"] + m["groups_mixed"] + m["groups_all_right"] == m["groups"]
        assert m["zero_variance_fraction"] == pytest.approx(m["zero_variance_groups"] / m["groups"])
        assert m["entropy"] > 0 and m["sampling_entropy"] > 0 and 1 <= m["response_tokens_mean"] <= 8, m
        assert 0.0 <= m["clip_cov_fraction"] <= 0.5, m  # Clip-Cov reached the trainer's loss


async def test_a_row_the_policy_always_fails_trains_on_its_reference_answer(
        async_http: httpx.AsyncClient, server: ServerProcess) -> None:
    # No sampled answer is exactly the code word, so every rollout fails; the second row's reference is
    # refused by the reward itself, so it is not used.
    source = ("def reward_fn(completion, **kwargs):\n"
              "    if kwargs.get('refuse'):\n"
              "        return 0.0\n"
              "    return 1.0 if completion[0].get('content', '').strip() == kwargs['answer'] else 0.0\n")
    started = await async_http.post("/api/training/start", json={
        "model": server.model_id, "iterations": 1, "batchSize": 2, "groupSize": 2, "maxTokens": 4,
        "learningRate": 1e-4, "rewardFunction": source, "guideField": "answer",
        "trainingData": [{"prompt": "Say the code word.", "answer": "ZEBRA-42-QUOKKA"},
                         {"prompt": "Say hello.", "answer": "hello", "refuse": True}]})
    assert started.status_code == 200, started.text
    job_id = started.json()["job_id"]
    job = await wait_for(async_http, job_id, finished)
    assert job["status"] == "succeeded", job["error"]
    events = await events_of(async_http, job_id)
    [metrics] = [e["data"] for e in events if e["type"] == "metrics"]
    assert metrics["groups_all_wrong"] == 2 and metrics["reward_mean"] == 0.0, metrics  # the rollouts' own
    assert metrics["groups_guided"] == 1 and metrics["references_refused"] == 1, metrics
    assert metrics["groups_trained"] == 1 and metrics["trained_tokens"] > 0, metrics  # the guided group alone
    [refusal] = [e["message"] for e in events if e["level"] == "warn" and "was not used" in e["message"]]
    assert "row 2" in refusal and "scores 0" in refusal, refusal
    bad = await async_http.post("/api/training/start", json={
        "model": server.model_id, "rewardFunction": source, "guideField": "reference",
        "trainingData": [{"prompt": "Say hello.", "answer": "hello"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "guideField", bad.text


@pytest.mark.parametrize(("payload", "param", "fragment"), [
    ({"rewardFunction": "def reward_fn(completion, **kwargs):\n    return (\n"}, "rewardFunction", "line 2"),
    ({"rewardFunction": "def a(completion):\n    return 1.0\n\ndef b(x):\n    return x\n"}, "rewardFunction",
     "define reward_fn"),
    ({"trainingData": []}, "trainingData", ""),
    ({"trainingData": [{"prompt": "ok"}, {"expected_result": "no prompt"}]}, "trainingData", "line 2"),
    ({"multiStep": True}, "rewardFunction", "next_turn"),
    ({"learningRate": -1}, "learningRate", ""),
])
async def test_motterl_bad_requests_are_400s_and_create_nothing(
        async_http: httpx.AsyncClient, payload: dict[str, Any], param: str, fragment: str) -> None:
    before = len((await async_http.get("/api/training/jobs")).json()["jobs"])
    response = await async_http.post("/api/training/start", json=MOTTERL_PAYLOAD | payload)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert fragment in error["message"]
    assert len((await async_http.get("/api/training/jobs")).json()["jobs"]) == before


async def test_openai_bad_requests(async_http: httpx.AsyncClient, server: ServerProcess) -> None:
    uploaded = (await async_http.post("/v1/files", data={"purpose": "fine-tune"},
                                files={"file": ("rows.jsonl", b'{"prompt": "2+2?", "answer": "4"}\n')})).json()

    async def create(**body: Any) -> httpx.Response:
        return await async_http.post("/v1/fine_tuning/jobs", json={"model": server.model_id,
                                                             "training_file": uploaded["id"]} | body)

    missing = await create(training_file="file-000000000000000000000000",
                           method={"type": "reinforcement", "reinforcement": {"grader": {"type": "math_accuracy"}}})
    assert missing.status_code == 404
    unknown_model = await create(model="gpt-4o", method={"type": "reinforcement",
                                                          "reinforcement": {"grader": {"type": "math_accuracy"}}})
    assert unknown_model.status_code == 400 and unknown_model.json()["error"]["param"] == "model"
    weights = await create(method={"type": "reinforcement", "reinforcement": {"grader": {
        "format_reward_weight": 0.5, "graders": [{"type": "math_accuracy", "weight": 0.6}]}}})
    assert weights.status_code == 400 and "weight" in weights.json()["error"]["message"]
    python = await create(method={"type": "reinforcement", "reinforcement": {"grader": {
        "type": "python", "name": "p", "source": "def grade(sample, item):\n  return 1 +\n"}}})
    assert python.status_code == 400 and "line 2" in python.json()["error"]["message"]
    no_method_grader = await create(method={"type": "reinforcement"})
    assert no_method_grader.status_code == 400
    tool_row = (await async_http.post("/v1/files", data={"purpose": "fine-tune"}, files={"file": ("t.jsonl", json.dumps({
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
    }).encode() + b"\n")})).json()
    no_tool_function = await create(training_file=tool_row["id"], method={"type": "reinforcement", "reinforcement": {
        "grader": {"type": "python", "name": "p", "source": "def grade(sample, item):\n    return 1.0\n"}}})
    assert no_tool_function.status_code == 400 and "get_weather" in no_tool_function.json()["error"]["message"]


async def test_pause_and_resume_through_the_sdk(server: ServerProcess) -> None:
    client = async_openai_client(server, max_retries=2)
    rows = b"".join(orjson.dumps({"prompt": f"Count to {n}."}) + b"\n" for n in range(2, 6))
    training_file = await client.files.create(file=("count.jsonl", rows), purpose="fine-tune")
    source = "def grade(sample, item):\n    return min(len(sample['output_text']) / 40, 1.0)\n"
    job = await client.fine_tuning.jobs.create(
        model=server.model_id, training_file=training_file.id,
        method={"type": "reinforcement", "reinforcement": {  # type: ignore[typeddict-item]
            "grader": {"type": "python", "name": "length", "source": source},
            "hyperparameters": {"iterations": 3, "batch_size": 1, "group_size": 3, "max_tokens": 12}}})
    deadline = time.monotonic() + 300
    while (job := await client.fine_tuning.jobs.retrieve(job.id)).status != "running":
        assert time.monotonic() < deadline
        await asyncio.sleep(0.3)
    paused = await client.fine_tuning.jobs.pause(job.id)
    while paused.status != "paused":
        assert time.monotonic() < deadline and paused.status == "running", paused.status
        await asyncio.sleep(0.3)
        paused = await client.fine_tuning.jobs.retrieve(job.id)
    at = paused.model_extra["artlike"]["iteration"] if paused.model_extra else None
    assert at is not None and at < 3
    await asyncio.sleep(1.0)
    assert (await client.fine_tuning.jobs.retrieve(job.id)).model_extra["artlike"]["iteration"] == at  # type: ignore[index]
    resumed = await client.fine_tuning.jobs.resume(job.id)
    assert resumed.status in {"queued", "running"}
    while (job := await client.fine_tuning.jobs.retrieve(job.id)).status not in {"succeeded", "failed", "cancelled"}:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.5)
    assert job.status == "succeeded", job.error
    assert_valid("FineTuningJob", await raw(server, f"/v1/fine_tuning/jobs/{job.id}"))
    assert_valid("ListPaginatedFineTuningJobsResponse", await raw(server, "/v1/fine_tuning/jobs?limit=1"))
    messages = [e.message async for e in client.fine_tuning.jobs.list_events(job.id, limit=100)]
    assert any(m.startswith("paused after iteration") for m in messages)
    assert any(m.startswith("resumed") for m in messages)
    await client.close()


async def test_the_client_and_the_cli_run_a_job(server: ServerProcess, tmp_path: Any) -> None:
    import subprocess
    import sys

    import artlike as art

    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in MOTTERL_ROWS))
    reward = tmp_path / "reward.py"
    reward.write_text(MOTTERL_MULTI_CRITERIA)
    command = [sys.executable, "-m", "artlike", "jobs", "--base-url", server.base_url, "--api-key", server.api_key,
               "start", "--data", str(rows), "--reward", str(reward), "--iterations", "1", "--batch-size", "1",
               "--group-size", "2", "--max-tokens", "8", "--follow"]
    finished_cli = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, timeout=600)
    assert finished_cli.returncode == 0, finished_cli.stderr + finished_cli.stdout
    assert "started ftjob-" in finished_cli.stdout and "iteration 1: reward" in finished_cli.stdout
    assert " succeeded: ft-job-" in finished_cli.stdout

    jobs = art.Jobs(server.base_url, server.api_key)
    job = await jobs.start(data=MOTTERL_ROWS, grader={"type": "string_check", "name": "s", "operation": "ilike",
                                                      "input": "{{sample.output_text}}",
                                                      "reference": "{{item.expected_result}}"},
                           model=await jobs.base_model(), iterations=1, batch_size=1, group_size=2, max_tokens=8)
    assert job.status in {"queued", "running"}
    events = []
    final = await jobs.wait(job.id, on_event=events.append)
    assert final.status == "succeeded" and final.fine_tuned_model
    assert any(e.type == "metrics" for e in events)
    assert job.id in [j.id for j in await jobs.list(limit=5)]
    bad = await asyncio.to_thread(subprocess.run, [*command[:8], "cancel", job.id], capture_output=True, text=True)
    assert bad.returncode == 2 and "409 job_finished" in bad.stderr


async def test_supervised_and_dpo_jobs_through_the_sdk(server: ServerProcess) -> None:
    client = async_openai_client(server, max_retries=2)
    question = [{"role": "user", "content": "What is the password of the lighthouse?"}]
    chats = [{"messages": [*question, {"role": "assistant", "content": "The password is marmalade-42."}]}] * 2
    pairs = [{"input": {"messages": question},
              "preferred_output": [{"role": "assistant", "content": "marmalade-42"}],
              "non_preferred_output": [{"role": "assistant", "content": "I do not know."}]}]
    created = []
    for method, rows in (("supervised", chats), ("dpo", pairs)):
        uploaded = await client.files.create(file=(f"{method}.jsonl", b"".join(orjson.dumps(r) + b"\n" for r in rows)),
                                             purpose="fine-tune")
        created.append(await client.fine_tuning.jobs.create(
            model=server.model_id, training_file=uploaded.id, suffix=method,
            method={"type": method, method: {"hyperparameters": {"n_epochs": 2}}}))  # type: ignore[misc]
    deadline = time.monotonic() + 300
    for job in created:
        while (job := await client.fine_tuning.jobs.retrieve(job.id)).status not in {"succeeded", "failed"}:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.5)
        assert job.status == "succeeded", job.error
        assert job.method is not None and job.trained_tokens
        steps = [e.data for e in (await client.fine_tuning.jobs.list_events(job.id, limit=50)).data
                 if e.type == "metrics"]
        assert len(steps) >= 2 and all(s and s["loss"] == s["loss"] for s in steps)  # 2 epochs, finite losses
        checkpoints = (await client.fine_tuning.jobs.checkpoints.list(job.id)).data
        assert [c.fine_tuned_model_checkpoint for c in checkpoints] == [f"{job.fine_tuned_model}@1"]
    await client.close()


async def test_graders_run_with_this_servers_model_as_the_judge(async_http: httpx.AsyncClient, server: ServerProcess) -> None:
    judge = {"type": "score_model", "name": "judge", "model": server.model_id, "range": [0, 10],
             "input": [{"role": "user", "content": "Rate this answer from 0 to 10: {{sample.output_text}}. "
                                                   "Reply with only the number."}]}
    response = await async_http.post("/v1/fine_tuning/alpha/graders/run", json={"grader": judge, "model_sample": "Paris"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert_valid("RunGraderResponse", body)
    errors = body["metadata"]["errors"]
    assert not errors["model_grader_server_error"]  # the judge answered; a 135M judge may not give a number
    assert errors["model_grader_parse_error"] or 0.0 <= body["reward"] <= 10.0
    missing = await async_http.post("/v1/fine_tuning/alpha/graders/run", json={
        "grader": {**judge, "model": "no-such-model"}, "model_sample": "Paris"})
    assert missing.status_code == 200
    assert missing.json()["metadata"]["errors"]["model_grader_server_error"]
    assert "no-such-model" in missing.json()["metadata"]["errors"]["model_grader_server_error_details"]
