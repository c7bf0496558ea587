"""The client library against the real server (real vLLM engine, real trainer): the README's snippet end
to end, the sync API, failed rollouts, typed errors, the openai SDK and LangChain through trajectory URLs,
and the curl walkthrough in client/curl_examples.sh.

Uses the session fixture `server` (tests/conftest.py): `.base_url`, `.model_id`, `.api_key`."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any
from uuid import uuid4

import orjson
import pytest
from artlike_server.launcher import ServerProcess
from openai.types.chat import ChatCompletion
from pydantic import ValidationError

import artlike as art

from .helpers import trainable_model

pytestmark = pytest.mark.integration

CLIENT_DIR = Path(__file__).resolve().parents[2] / "client"
PROMPTS = ["Name a colour and say why you like it.", "Describe the sea in a few words."]


def new_model(server: ServerProcess, name: str | None = None, **options: Any) -> art.TrainableModel:
    return trainable_model(server, name or f"client-{uuid4().hex[:10]}", **options)


def length_reward(completion: ChatCompletion) -> float:
    """Varies from sample to sample at temperature 1, so every group carries a GRPO signal."""
    return len(completion.choices[0].message.content or "") / 64


def sampling(model: str, prompt: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 1.0, "max_tokens": 16}


async def test_the_design_snippet_end_to_end(server: ServerProcess) -> None:
    model = new_model(server)
    info = await model.register()  # creates step 0: a fresh LoRA, identical to the base
    assert (info.latest_step, info.served_name, info.base_model) == (0, f"{model.name}@0", server.model_id)

    async def rollout(scenario: str) -> art.Trajectory:
        async with model.trajectory() as t:
            assert t.base_url == f"{server.base_url}/t/{t.id}/v1"
            completion = await t.async_openai_client().chat.completions.create(**sampling(model.name, scenario))
            t.reward = length_reward(completion)
        return t

    groups = await art.gather_trajectory_groups(
        art.TrajectoryGroup(rollout(s) for _ in range(4)) for s in PROMPTS)
    assert [len(group.trajectories) for group in groups] == [4, 4]
    events = []
    async for event in model.train(groups, learning_rate=1e-5):
        events.append(event)

    start, done = events[0], events[-1]
    assert isinstance(start, art.StartEvent) and isinstance(done, art.DoneEvent)
    assert (start.model, start.from_step, start.trajectories, start.groups) == (model.name, 0, 8, 2)
    assert start.groups_skipped < start.groups
    steps = [event for event in events if isinstance(event, art.StepEvent)]
    assert [event.gradient_step for event in steps] == list(range(1, start.num_gradient_steps + 1))
    assert all(event.tokens > 0 for event in steps)
    assert (done.trained, done.step, done.model) == (True, 1, f"{model.name}@1")
    assert await model.get_step() == 1
    assert [step.step for step in await model.list_steps()] == [0, 1]

    # Every rollout was recorded on step 0; the next rollout already talks to the new adapter.
    for trajectory in (t for group in groups for t in group):
        [record] = (await trajectory.get_record()).completions
        assert (record.step, record.served_model) == (0, f"{model.name}@0")
    [after] = (await (await rollout(PROMPTS[0])).get_record()).completions
    assert (after.step, after.served_model, after.model) == (1, f"{model.name}@1", model.name)


def test_the_sync_api(server: ServerProcess) -> None:
    model = new_model(server)
    first = model.register_sync()
    again = model.register_sync()  # idempotent: the same model, not a new one
    assert (again.name, again.created_at, again.latest_step) == (first.name, first.created_at, 0)
    groups = []
    for prompt in PROMPTS:
        trajectories = []
        for _ in range(4):
            with model.trajectory() as t:
                t.reward = length_reward(t.openai_client().chat.completions.create(**sampling(t.model, prompt)))
            trajectories.append(t)
        groups.append(art.TrajectoryGroup(trajectories))

    seen: list[str] = []
    result = model.train_sync(groups, progress=False, on_event=lambda event: seen.append(event.type))
    assert (result.step, result.model, result.trained) == (1, f"{model.name}@1", True)
    assert result.start is not None and len(result.metrics) == result.start.num_gradient_steps
    assert seen[0] == "start" and seen[-1] == "done" and seen.count("step") == len(result.metrics)
    assert model.get_step_sync() == 1
    assert model.delete_steps_sync(keep=1) == [0]
    assert [step.step for step in model.list_steps_sync()] == [1]


async def test_a_failed_rollout_does_not_lose_its_group(server: ServerProcess) -> None:
    model = new_model(server)
    await model.register()

    async def rollout(prompt: str, fail: bool) -> art.Trajectory:
        async with model.trajectory() as t:
            completion = await t.async_openai_client().chat.completions.create(**sampling(model.name, prompt))
            if fail:
                raise RuntimeError("the agent could not parse its own answer")
            t.reward = length_reward(completion)
        return t

    groups = await art.gather_trajectory_groups(
        (art.TrajectoryGroup(rollout(p, fail=i == 0) for i in range(4)) for p in PROMPTS),
        max_exceptions=2, concurrency=4, progress=False)
    assert [len(group.trajectories) for group in groups] == [3, 3]
    assert all(isinstance(group.exceptions[0], RuntimeError) for group in groups)

    result = await model.train(groups, progress=False)  # the await form
    assert result.start is not None and result.start.trajectories == 6
    assert (result.step, result.trained) == (1, True)
    assert await model.get_step() == 1


async def test_server_errors_map_to_typed_exceptions(server: ServerProcess) -> None:
    with pytest.raises(art.NotFoundError) as missing:
        await new_model(server).get_step()
    assert missing.value.status_code == 404

    model = new_model(server)
    await model.register()
    with pytest.raises(art.ConflictError, match=model.name):
        await new_model(server, model.name, lora={"rank": 4}).register()
    with pytest.raises(art.BadRequestError) as wrong_base:
        await art.TrainableModel(f"client-{uuid4().hex[:10]}", "not/the-served-model", server.base_url,
                                 api_key=server.api_key).register()
    assert wrong_base.value.param == "base_model"
    if server.api_key:
        with pytest.raises(art.AuthenticationError):
            await new_model(server, model.name, api_key=server.api_key + "-wrong").get_step()

    offline = [art.Trajectory([{"role": "user", "content": "hi"}, {"role": "assistant", "content": text}],
                              reward=reward) for text, reward in (("hello", 1.0), ("go away", 0.0))]
    with pytest.raises(ValidationError):
        model.train([art.TrajectoryGroup(offline)], learning_rate=-1.0)
    assert await model.get_step() == 0


async def test_the_openai_sdk_sync_async_and_streaming_through_a_trajectory(server: ServerProcess) -> None:
    model = new_model(server)
    await model.register()
    request: dict[str, Any] = {"model": model.name, "messages": [{"role": "user", "content": "Count to five."}],
                               "max_tokens": 12, "temperature": 0.0}
    async with model.trajectory() as t:
        async_client, sync_client = t.async_openai_client(), t.openai_client()
        plain = await async_client.chat.completions.create(**request)
        async_stream = await async_client.chat.completions.create(**request, stream=True)
        async_text = "".join([chunk.choices[0].delta.content or "" async for chunk in async_stream if chunk.choices])
        sync_plain = sync_client.chat.completions.create(**request)
        sync_text = "".join(chunk.choices[0].delta.content or ""
                            for chunk in sync_client.chat.completions.create(**request, stream=True) if chunk.choices)

    text = plain.choices[0].message.content
    assert text and text == async_text == sync_plain.choices[0].message.content == sync_text  # greedy, float32
    assert plain.choices[0].logprobs is None  # recorded, but not returned unless asked for
    assert plain.usage is not None

    record = await t.get_record()
    assert record.trajectory_id == t.id
    assert len(record.completions) == 4
    assert len({c.request_id for c in record.completions}) == 4
    for completion in record.completions:
        assert (completion.endpoint, completion.model, completion.served_model, completion.step) == (
            "chat.completions", model.name, f"{model.name}@0", 0)
        assert completion.request["messages"] == request["messages"]
        assert len(completion.output_token_ids) == len(completion.logprobs) == plain.usage.completion_tokens
        assert completion.output_token_ids == record.completions[0].output_token_ids
        assert completion.finish_reason == plain.choices[0].finish_reason
        assert all(logprob <= 0.0 for logprob in completion.logprobs)


@pytest.mark.skipif(shutil.which("curl") is None or shutil.which("jq") is None, reason="needs curl and jq")
def test_the_curl_walkthrough_runs_and_ends_with_a_done_line(server: ServerProcess) -> None:
    name = f"client-curl-{uuid4().hex[:8]}"
    environment = os.environ | {"ARTLIKE_SERVER": server.base_url, "ARTLIKE_BASE_MODEL": server.model_id,
                                "ARTLIKE_MODEL": name, "ARTLIKE_API_KEY": server.api_key or ""}
    result = subprocess.run(["bash", str(CLIENT_DIR / "curl_examples.sh")], capture_output=True, text=True,
                            env=environment, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    last = orjson.loads(result.stdout.strip().splitlines()[-1])
    assert (last["type"], last["model"], last["step"]) == ("done", f"{name}@1", 1)
    assert new_model(server, name).get_step_sync() == 1


@pytest.mark.parametrize(("objective", "metric"), [("cispo", "is_weight"), ("gspo", "sequence_ratio")])
async def test_other_policy_gradient_objectives_train_a_step(server: ServerProcess, objective: str, metric: str) -> None:
    model = new_model(server)
    await model.register()

    async def rollout() -> art.Trajectory:
        async with model.trajectory() as t:
            completion = await t.async_openai_client().chat.completions.create(**sampling(model.name, PROMPTS[0]))
            t.reward = length_reward(completion)
        return t

    groups = await art.gather_trajectory_groups([art.TrajectoryGroup(rollout() for _ in range(4))])
    events = [event async for event in model.train(groups, objective=objective, learning_rate=1e-5, progress=False)]
    steps = [event for event in events if isinstance(event, art.StepEvent)]
    assert steps and all(step.objective == objective and metric in step.metrics for step in steps)
    done = events[-1]
    assert isinstance(done, art.DoneEvent) and (done.trained, done.step) == (True, 1)
    [entry] = [s for s in await model.list_steps() if s.step == 1]
    assert entry.step == 1


TYPESCRIPT_DIR = CLIENT_DIR / "typescript"


@pytest.mark.skipif(shutil.which("node") is None or shutil.which("npm") is None, reason="needs node and npm")
def test_the_typescript_example_trains_a_step(server: ServerProcess) -> None:
    """client/typescript/train_one_step.ts with the official `openai` npm package: installed (package-lock),
    type-checked and compiled by `tsc`, then run under node against the real server."""
    def npm(*args: str) -> None:
        result = subprocess.run(["npm", *args], cwd=TYPESCRIPT_DIR, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"npm {' '.join(args)}:\n{result.stdout}{result.stderr}"

    if not (TYPESCRIPT_DIR / "node_modules").is_dir():
        npm("ci", "--no-audit", "--no-fund")
    npm("run", "build")
    name = f"client-ts-{uuid4().hex[:8]}"
    environment = os.environ | {"ARTLIKE_SERVER": server.base_url, "ARTLIKE_BASE_MODEL": server.model_id,
                                "ARTLIKE_MODEL": name, "ARTLIKE_API_KEY": server.api_key or ""}
    result = subprocess.run(["node", "dist/train_one_step.js"], cwd=TYPESCRIPT_DIR, capture_output=True,
                            text=True, env=environment, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    last = orjson.loads(result.stdout.strip().splitlines()[-1])
    assert (last["type"], last["model"], last["step"]) == ("done", f"{name}@1", 1)
    assert "output_tokens=" in result.stderr  # it read the trajectory's record
    assert new_model(server, name).get_step_sync() == 1
