"""`art.PipelineTrainer` on the real server: rollouts of the next step sample while a step trains, staleness
stays within the bound, evaluations land in the history, retention keeps the best evaluated step and the
newest, the saved state resumes, and a guide's reference trains with a group whose rollouts all failed.
Learning evidence (`make test-learning`): the same pipeline, larger,
also learns.

The learning test's task is tests/integration/test_learning.py's yes/no questions (reward 1 for an answer
starting with "yes"), which the full default model learns in about three steps; the mechanics test rewards
the answer's length. Rollouts go through the official `openai` client on trajectory URLs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from artlike_server.launcher import ServerProcess

import artlike as art

from .helpers import async_http_client, trainable_model
from .test_learning import INSTRUCTION, LEARNING_RATE, MAX_TOKENS, SAMPLES, TRAIN, held_out_reward, reward

pytestmark = pytest.mark.integration

async def run_pipeline(server: ServerProcess, tmp_path: Path, name: str, *, steps: int, group_size: int,
                       groups_per_step: int, evaluate_on: int, score: Callable[[str], float] = reward,
                       **options: Any) -> tuple[art.TrainableModel, art.PipelineResult]:
    """Runs the pipeline (`options`: more `PipelineTrainer` keywords) and checks its mechanics; returns the
    model and the result for what a caller adds."""
    model = trainable_model(server, name, lora={"rank": 8})
    await model.register()

    async def rollout(question: str) -> art.Trajectory:
        async with model.trajectory(metadata={"question": question}) as t:
            client = t.async_openai_client(timeout=300)
            completion = await client.chat.completions.create(
                model=t.model, messages=[{"role": "user", "content": INSTRUCTION + question}],
                max_tokens=MAX_TOKENS, temperature=1.0)
            t.reward = score(completion.choices[0].message.content or "")
        return t

    async def evaluate(step: int) -> dict[str, float]:
        return {"reward": await held_out_reward(server, f"{name}@{step}", samples=evaluate_on)}

    trained: list[art.Trajectory] = []

    async def keep(group: art.TrajectoryGroup) -> art.TrajectoryGroup:
        trained.extend(group.trajectories)
        return group

    state = tmp_path / "pipeline.json"
    trainer = art.PipelineTrainer(
        model, rollout, TRAIN * 4, group_size=group_size, groups_per_step=groups_per_step, max_steps_off_policy=1,
        score_group=keep, evaluate=evaluate, eval_every=steps, keep_last=1, state_path=state, progress=False,
        learning_rate=LEARNING_RATE, **options)
    result = await trainer.run(num_steps=steps)
    print([step.model_dump(exclude={"metrics"}) for step in result.steps], result.evaluations)

    assert result.stopped == "num_steps" and len(result.steps) == steps
    assert all(step.staleness_max <= 1 for step in result.steps)
    # Two steps' groups start at step 0; the second step's train from step 1: one step off policy.
    assert result.steps[1].staleness_max == 1
    assert all(step.logprob_mismatch is not None for step in result.steps if step.trained)
    assert all(step.clip_fraction is not None and 0.0 <= step.clip_fraction <= 1.0
               for step in result.steps if step.trained)
    assert 0 < result.engine_busy_fraction <= 1 and 0 < result.trainer_busy_fraction <= 1

    # Every rollout called the latest served step: the step the server recorded is the one served when
    # the rollout began (or the next, when a swap landed in between).
    for trajectory in trained[:8]:
        record = await trajectory.get_record()
        recorded_step = record.completions[0].step or 0
        assert trajectory.metadata["policy_step"] <= recorded_step <= trajectory.metadata["policy_step"] + 1

    before, after = result.evaluations[0]["reward"], result.evaluations[result.final_step]["reward"]
    async with async_http_client(server, timeout=60) as http:
        history = (await http.get(f"/v1/trainable_models/{name}/history")).json()["data"]
        evals = {line["step"]: line["eval"] for line in history if line.get("event") == "eval"}
        assert evals == {0: {"reward": before}, result.final_step: {"reward": after}}
        configs = [line["config"] for line in history if "event" not in line]  # what each step trained with
        assert configs and all(c["objective"] == "grpo" and c["learning_rate"] == LEARNING_RATE for c in configs)
        assert [c["entropy_coef"] for c in configs] == [s.entropy_coef for s in result.steps if s.trained]
        bad = await http.post(f"/v1/trainable_models/{name}/evaluations", json={"step": 99, "metrics": {"r": 1}})
        assert bad.status_code == 404 and bad.json()["error"]["code"] == "step_not_found"
        bad = await http.post(f"/v1/trainable_models/{name}/evaluations", json={"step": 1, "metrics": {}})
        assert bad.status_code == 400
    # keep_last=1 plus the best evaluated step (step 0 or the latest) and step 0: the steps between are gone.
    assert [step.step for step in await model.list_steps()] == [0, result.final_step]

    saved = json.loads(state.read_text())
    assert saved["steps_done"] == steps and saved["served_step"] == result.final_step
    again = await art.PipelineTrainer(model, rollout, TRAIN * 4, group_size=group_size,
                                      groups_per_step=groups_per_step, evaluate=evaluate, eval_every=steps,
                                      state_path=state, progress=False).run(num_steps=steps)
    assert again.stopped == "num_steps" and len(again.steps) == steps  # resumed: nothing left to do
    assert await model.get_step() == result.final_step
    return model, result


async def test_pipeline_samples_while_training_within_its_staleness_bound(server: ServerProcess,
                                                                         tmp_path: Path) -> None:
    # The reward is the answer's length: sampled answers of the stand-in model differ in length, so no step's
    # groups all tie (a step that does not train would break the staleness check below).
    # The entropy control raises the bonus after a step whose sampling entropy is under its target (any is
    # under 10 nats a token), and the server trains each step with the coefficient its report names.
    _, result = await run_pipeline(server, tmp_path, "pipeliner", steps=2, group_size=8, groups_per_step=2,
                                   evaluate_on=2, score=lambda text: len(text) / 100, entropy_coef=0.001,
                                   entropy_control=art.EntropyControl(target=10.0, coef_step=0.002))
    assert [s.entropy_coef for s in result.steps] == pytest.approx([0.001, 0.003], rel=1e-9)
    assert all(s.sampling_entropy is not None and 0 < s.sampling_entropy < 10 for s in result.steps), result.steps


@pytest.mark.learning
async def test_pipeline_learns(capable_server: ServerProcess, tmp_path: Path) -> None:
    server = capable_server  # learning evidence is about the embedded model: the full one
    _, result = await run_pipeline(server, tmp_path, "pipeline-learner", steps=3, group_size=8, groups_per_step=4,
                                   evaluate_on=SAMPLES)
    before, after = result.evaluations[0]["reward"], result.evaluations[result.final_step]["reward"]
    assert after >= before + 0.3 and after >= 0.6, result.evaluations
    assert result.best_step == result.final_step


async def test_a_guide_reference_joins_and_trains_a_group_whose_rollouts_all_failed(server: ServerProcess) -> None:
    model = trainable_model(server, "guided", lora={"rank": 8})
    await model.register()
    reference = "Zebra quokka forty-two."  # no sampled answer of 4 tokens is exactly this: every rollout fails

    def prompt(question: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": INSTRUCTION + question}]

    async def rollout(question: str) -> art.Trajectory:
        async with model.trajectory() as t:
            completion = await t.async_openai_client(timeout=300).chat.completions.create(
                model=t.model, messages=prompt(question), max_tokens=4, temperature=1.0)  # type: ignore[arg-type]
            t.reward = float(completion.choices[0].message.content == reference)
        return t

    def guide(question: str) -> art.Trajectory:
        return art.Trajectory([*prompt(question), {"role": "assistant", "content": reference}], reward=1.0)

    result = await art.PipelineTrainer(model, rollout, TRAIN[:2], group_size=2, groups_per_step=2,
                                       max_steps_off_policy=0, guide=guide, progress=False,
                                       learning_rate=LEARNING_RATE).run(num_steps=1)
    [step] = result.steps
    assert step.trained and step.groups_guided == 2 and step.trajectories == 4 and step.reward_mean == 0.0, step
    async with async_http_client(server, timeout=60) as http:
        history = (await http.get("/v1/trainable_models/guided/history")).json()["data"]
    [line] = [line for line in history if "event" not in line]
    # The server trained each group with its reference: one trajectory of three passing in each.
    assert line["groups_mixed"] == 2 and line["groups_skipped"] == 0 and line["pass_rate"] == pytest.approx(1 / 3)


async def test_a_hotter_retry_joins_and_trains_a_group_whose_rollouts_all_failed(server: ServerProcess) -> None:
    model = trainable_model(server, "retried", lora={"rank": 8})
    await model.register()
    temperatures: list[float] = []

    async def rollout(question: str) -> art.Trajectory:  # a task only a hotter sample solves
        temperature = art.rollout_temperature(1.0)
        temperatures.append(temperature)
        async with model.trajectory() as t:
            await t.async_openai_client(timeout=300).chat.completions.create(
                model=t.model, messages=[{"role": "user", "content": INSTRUCTION + question}],  # type: ignore[list-item]
                max_tokens=4, temperature=temperature)
            t.reward = float(temperature >= 1.5)
        return t

    result = await art.PipelineTrainer(model, rollout, TRAIN[:2], group_size=2, groups_per_step=2,
                                       max_steps_off_policy=0, retry_failed=art.RetryFailedGroups(temperature=1.5),
                                       progress=False, learning_rate=LEARNING_RATE).run(num_steps=1)
    [step] = result.steps
    assert sorted(temperatures) == [1.0] * 4 + [1.5] * 4
    assert step.trained and (step.groups_retried, step.groups_rescued) == (2, 2), step
    assert step.trajectories == 4 and step.reward_mean == 0.0, step  # the first rollouts'
    async with async_http_client(server, timeout=60) as http:
        history = (await http.get("/v1/trainable_models/retried/history")).json()["data"]
    [line] = [line for line in history if "event" not in line]
    # The server trained each group with its retry: two of its four trajectories passing.
    assert line["groups_mixed"] == 2 and line["groups_skipped"] == 0 and line["pass_rate"] == pytest.approx(0.5)
