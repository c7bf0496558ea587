"""`art.judge_group` with the real engine as the judge: a group of recorded trajectories from the default model,
judged by the same server's base model through its plain `/v1` (not a trajectory URL, so judging records
nothing), with structured output (vLLM 0.32's `response_format` json_schema, xgrammar, works on the CPU
build). The 135M model's judgement is not the point; the mechanics are: a score in [0, 1] per trajectory, the
explanations, the original rewards kept, and a cache that answers a repeated request without asking again.

Uses the session fixture `capable_server` (tests/conftest.py): `.base_url`, `.model_id`, `.api_key`."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from uuid import uuid4

import httpx
import pytest
from artlike_server.launcher import ServerProcess

import artlike as art

from .helpers import api_url, async_openai_client, trainable_model

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server(capable_server: ServerProcess) -> ServerProcess:
    """A judge that writes the JSON asked for: the full embedded model."""
    return capable_server

QUESTION = "Name one fruit and say what colour it is."


async def recorded_group(server: ServerProcess, size: int) -> art.TrajectoryGroup:
    model = trainable_model(server, f"judged-{uuid4().hex[:10]}")
    await model.register()

    async def rollout(index: int) -> art.Trajectory:
        async with model.trajectory() as t:
            await t.async_openai_client().chat.completions.create(
                model=t.model, messages=[{"role": "user", "content": QUESTION}], temperature=1.0, max_tokens=16)
            t.reward = index / size  # a stand-in for the rollout's own reward: kept as independent_reward
        return t

    [group] = await art.gather_trajectory_groups([art.TrajectoryGroup(rollout(i) for i in range(size))],
                                                 progress=False)
    return group


# max_explanation_chars: the small model would otherwise fill max_tokens with one explanation. vLLM's own
# structured_outputs with whitespace off: with response_format json_schema the 135M judge once padded its
# answer with whitespace until max_tokens cut it off (a CI run, 2026-11-25); xgrammar allows any amount of it.
# A little temperature: at 0 a retry repeats the same bad answer word for word (the 135M judge's answer is
# sometimes cut off by max_tokens even so: CI, 2026-11-25), so the tests allow retries and they can differ.
JUDGE_OPTIONS: dict[str, Any] = {"max_tokens": 1000, "max_explanation_chars": 120, "temperature": 0.5,
                                 "response_format": "structured_outputs"}
RETRIES = 3


def engine_judge(server: ServerProcess, **options: Any) -> art.Judge:
    return art.Judge(model=server.model_id, base_url=api_url(server), api_key=server.api_key,
                     **JUDGE_OPTIONS, **options)


async def test_the_servers_own_model_judges_a_recorded_group(server: ServerProcess, tmp_path: Path) -> None:
    group = await recorded_group(server, 3)
    judge = engine_judge(server, cache_dir=tmp_path)

    judged = await art.judge_group(group, judge, retries=RETRIES)

    assert [t.id for t in judged] == [t.id for t in group]
    assert all(isinstance(t.reward, float) and 0.0 <= t.reward <= 1.0 for t in judged)
    assert [t.metrics["independent_reward"] for t in judged] == [0.0, 1 / 3, 2 / 3]
    for trajectory in judged:
        assert trajectory.metadata["judge_model"] == server.model_id
        assert trajectory.metadata["judge_score"] == trajectory.reward
        assert isinstance(trajectory.metadata["judge_explanation"], str)
        assert len(trajectory.metadata["judge_explanation"]) <= 120
        assert trajectory.metadata["judge_cached"] is False
    assert group.rewards == [0.0, 1 / 3, 2 / 3]  # the input group is left as it was

    # The same request again: answered from the memory cache, then by a new judge from the disk cache,
    # through a client that counts what it sends: nothing.
    again = await art.judge_group(group, judge, retries=0)
    assert again.rewards == judged.rewards and all(t.metadata["judge_cached"] for t in again)
    sent: list[httpx.Request] = []

    async def count(request: httpx.Request) -> None:
        sent.append(request)

    client = async_openai_client(server, max_retries=2,
                                 http_client=httpx.AsyncClient(event_hooks={"request": [count]}))  # type: ignore[arg-type]
    from_disk = art.Judge(model=server.model_id, client=client, cache_dir=tmp_path, **JUDGE_OPTIONS)
    restored = await art.judge_group(group, from_disk, retries=0)
    await client.close()
    assert restored.rewards == judged.rewards and sent == []


async def test_judge_groups_judges_several_groups_and_nothing_is_recorded_for_the_judge(server: ServerProcess) -> None:
    groups = [await recorded_group(server, 2), await recorded_group(server, 2)]
    judged = await art.judge_groups(groups, engine_judge(server), concurrency=2, on_failure="raise", progress=False,
                                    retries=RETRIES)
    assert [len(group) for group in judged] == [2, 2]
    assert all(0.0 <= (t.reward or 0.0) <= 1.0 and "judge_explanation" in t.metadata for g in judged for t in g)
    for trajectory in (t for group in judged for t in group):  # each still has only its own rollout's completion
        assert len((await trajectory.get_record()).completions) == 1
