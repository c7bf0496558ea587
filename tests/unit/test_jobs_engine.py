"""The job engine's own rules, without a server: the store, batching, stop flags, request intake (MotteRL and
OpenAI bodies to a JobSpec), the wire objects against the OpenAI schema, and episodes (tool calls and
next_turn) against a scripted chat endpoint with the real sandbox running the user's functions."""

from __future__ import annotations

import asyncio
import doctest
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from artlike_server.errors import InvalidRequest, NotFound
from artlike_server.jobs import motterl, openai_jobs
from artlike_server.jobs.datasets import PromptRow
from artlike_server.jobs.episodes import run_episode
from artlike_server.jobs.guidance import guide_groups
from artlike_server.jobs.intake import check_episode_functions, grader_reward, python_reward
from artlike_server.jobs.rewards import JobReward, reward_value, sample_of
from artlike_server.jobs.runner import StopFlag, Stopped, batch_rows
from artlike_server.jobs.sandbox import Sandbox, SandboxLimits
from artlike_server.jobs.service import JobService
from artlike_server.jobs.spec import JobSpec, RemedySettings, RolloutSettings
from artlike_server.jobs.store import JobStore

import artlike as art
from artlike import DynamicSampling, EntropyControl, Schedule
from tests.openapi_schema import assert_valid

MOTTERL_PAYLOAD = {
    "model": "qwen-2.5-7b", "learningRate": 0.01, "iterations": "100", "batchSize": 8, "multiStep": False,
    "rewardFunction": "def reward_fn(completion, **kwargs):\n    return 1.0\n",
    "trainingData": [{"prompt": "What is AI?", "expected_result": "Artificial Intelligence"},
                     {"prompt": "Define ML", "expected_result": "Machine Learning"}],
}


def spec(**overrides: Any) -> JobSpec:
    base: dict[str, Any] = {"api": "openai", "method": "reinforcement", "base_model": "base", "target_model": "ft-x",
                            "create_target": True, "iterations": 3, "train_rows": 2,
                            "reward": {"kind": "python", "source": "def reward_fn(c, **k):\n    return 1\n",
                                       "entry": "reward_fn"}}
    return JobSpec.model_validate(base | overrides)


# ------------------------------------------------------------------------------------------ store


def test_store_keeps_jobs_events_and_checkpoints_across_reopening(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    seen: list[str] = []
    store.on_event = seen.append
    job = store.create("ftjob-a", spec(), training_file="file-1", validation_file=None, suffix="s",
                       metadata={"k": "v"}, train_rows=[{"prompt": "p"}], validation_rows=[])
    assert job.status == "queued" and job.iteration == 0 and job.start_step is None
    first = store.add_event("ftjob-a", "created")
    second = store.add_event("ftjob-a", "iteration 1", type="metrics", data={"iteration": 1})
    assert seen == ["ftjob-a", "ftjob-a"] and first.id == f"ftevent-{first.seq}"
    store.add_checkpoint("ftjob-a", 1, "ft-x@1", {"train_loss": 0.5})
    store.update("ftjob-a", status="running", iteration=1, last_metrics={"loss": 0.5})
    store.close()

    reopened = JobStore(tmp_path)
    job = reopened.get("ftjob-a")
    assert (job.status, job.iteration, job.last_metrics, job.metadata) == ("running", 1, {"loss": 0.5}, {"k": "v"})
    assert reopened.rows("ftjob-a", "train") == [{"prompt": "p"}]
    assert [e.message for e in reopened.events("ftjob-a")] == ["created", "iteration 1"]
    assert [e.message for e in reopened.events("ftjob-a", after_seq=first.seq)] == ["iteration 1"]
    assert [e.id for e in reopened.events("ftjob-a", newest_first=True)] == [second.id, first.id]
    assert [e.id for e in reopened.events("ftjob-a", newest_first=True, after_seq=second.seq)] == [first.id]
    assert [c.model_checkpoint for c in reopened.checkpoints("ftjob-a")] == ["ft-x@1"]
    assert [j.id for j in reopened.unfinished()] == ["ftjob-a"]
    done = reopened.update("ftjob-a", status="succeeded")
    assert done.finished and done.finished_at is not None and reopened.unfinished() == []


def test_store_lists_newest_first_with_a_cursor_and_metadata_filter(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    for i in range(3):
        store.create(f"ftjob-{i}", spec(), training_file=None, validation_file=None, suffix=None,
                     metadata={"n": str(i % 2)}, train_rows=[{"prompt": "p"}], validation_rows=[])
    page, more = store.page(limit=2)
    assert len(page) == 2 and more
    rest, more = store.page(limit=2, after=page[-1].id)
    assert not more and {j.id for j in page + rest} == {"ftjob-0", "ftjob-1", "ftjob-2"}
    odd, _ = store.page(limit=10, metadata={"n": "1"})
    assert [j.id for j in odd] == ["ftjob-1"]


# ------------------------------------------------------------------------------- batching, stopping


def rows(n: int) -> list[PromptRow]:
    return [PromptRow(line=i + 1, messages=[{"role": "user", "content": str(i)}], tools=None, item={"i": i})
            for i in range(n)]


def test_the_service_pages_checkpoints_and_reads_every_event(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    store.create("ftjob-c", spec(), training_file=None, validation_file=None, suffix=None, metadata=None,
                 train_rows=[{"prompt": "p"}], validation_rows=[])
    saved = [store.add_checkpoint("ftjob-c", step, f"ft-x@{step}", {}) for step in (1, 2, 3)]
    messages = [f"event {i}" for i in range(1005)]  # more than one page of the store
    for message in messages:
        store.add_event("ftjob-c", message)
    service = JobService(store, None, None, None)  # type: ignore[arg-type]
    newest, has_more = service.checkpoints("ftjob-c", after=None, limit=2)
    assert [c.id for c in newest] == [saved[2].id, saved[1].id] and has_more
    rest, has_more = service.checkpoints("ftjob-c", after=saved[1].id, limit=2)
    assert [c.id for c in rest] == [saved[0].id] and not has_more
    assert service.checkpoints("ftjob-c", after="ftckpt-unknown", limit=2) == ([], False)
    assert [e.message for e in service.all_events("ftjob-c")] == messages
    with pytest.raises(NotFound):
        service.checkpoints("ftjob-none", after=None, limit=2)
    store.close()


def test_batches_cover_every_row_once_per_epoch_and_are_reproducible() -> None:
    data = rows(6)
    epoch = [r.line for it in range(3) for r in batch_rows(data, iteration=it, batch_size=2, seed=5)]
    assert sorted(epoch) == [1, 2, 3, 4, 5, 6]  # three iterations of 2 = one epoch, no repeats
    again = [r.line for it in range(3) for r in batch_rows(data, iteration=it, batch_size=2, seed=5)]
    assert again == epoch
    other_seed = [r.line for it in range(3) for r in batch_rows(data, iteration=it, batch_size=2, seed=6)]
    assert sorted(other_seed) == sorted(epoch)
    assert len(batch_rows(rows(2), iteration=0, batch_size=8, seed=0)) == 2  # never more rows than there are


async def test_a_stop_interrupts_waiting_work_and_cancel_beats_pause() -> None:
    flag = StopFlag()
    assert await flag.interruptible(asyncio.sleep(0, result=7)) == 7
    flag.check()
    cancelled = asyncio.Event()

    async def forever() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    waiting = asyncio.ensure_future(flag.interruptible(forever()))
    await asyncio.sleep(0.01)
    flag.request("pause")
    with pytest.raises(Stopped):
        await waiting
    assert cancelled.is_set()
    flag.request("cancel")
    flag.request("pause")
    assert flag.requested == "cancel"
    with pytest.raises(Stopped):
        flag.check()


def test_learning_rate_outside_the_seen_range_warns() -> None:
    assert spec(learning_rate=1e-5).learning_rate_warning() is None
    warning = spec(learning_rate=0.01).learning_rate_warning()
    assert warning is not None and "0.01" in warning


# --------------------------------------------------------------------------------------- intake


def test_reward_entry_rules() -> None:
    assert python_reward("def reward_fn(completion, **kw):\n    return 1\n", param="r").entry == "reward_fn"
    assert python_reward("def grade(sample, item):\n    return 1\n", param="r").entry == "grade"
    only = python_reward("def multi_criteria_reward(completion, **kw):\n    return 1\n\n"
                         "def next_turn(messages, **kw):\n    return None\n", param="r")
    assert only.entry == "multi_criteria_reward" and "next_turn" in only.functions
    with pytest.raises(InvalidRequest, match="define reward_fn"):
        python_reward("def a(c):\n    return 1\n\ndef b(c):\n    return 2\n", param="r")
    with pytest.raises(InvalidRequest, match="line 2") as error:
        python_reward("def reward_fn(c):\n    return (\n", param="rewardFunction")
    assert error.value.param == "rewardFunction"


def test_grader_configs_are_checked_before_a_job_exists() -> None:
    assert grader_reward({"type": "math_accuracy"}, param="g").kind == "grader"
    python = grader_reward({"type": "python", "name": "p", "source": "def grade(s, i):\n    return 1\n"}, param="g")
    assert python.kind == "python" and python.entry == "grade"
    with pytest.raises(InvalidRequest, match="weight"):
        grader_reward({"format_reward_weight": 0.5, "graders": [{"type": "math_accuracy", "weight": 0.6}]},
                      param="g")
    with pytest.raises(InvalidRequest, match="line 1"):
        grader_reward({"type": "multi", "calculate_output": "a", "graders": {
            "a": {"type": "python", "name": "a", "source": "def grade(s, i) return 1\n"}}}, param="g")
    with pytest.raises(InvalidRequest) as error:
        grader_reward({"type": "string_check", "name": "s", "input": "x", "reference": "y", "operation": "nope"},
                      param="g")
    assert error.value.param is not None and error.value.param.startswith("g")


def test_tools_and_multi_step_need_their_functions() -> None:
    reward = python_reward("def reward_fn(c, **k):\n    return 1\n\ndef lookup(key):\n    return key\n", param="r")
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    row = PromptRow(line=4, messages=[{"role": "user", "content": "x"}], tools=[tool], item={})
    check_episode_functions([row], reward, multi_step=False, param="r")
    other = PromptRow(line=5, messages=[{"role": "user", "content": "x"}],
                      tools=[{"type": "function", "function": {"name": "search"}}], item={})
    with pytest.raises(InvalidRequest, match=r"line 5.*search"):
        check_episode_functions([row, other], reward, multi_step=False, param="r")
    with pytest.raises(InvalidRequest, match="next_turn"):
        check_episode_functions([row], reward, multi_step=True, param="r")


def test_motterl_example_payload_becomes_a_spec(tmp_path: Path) -> None:
    from artlike_server.models.store import ModelStore

    start = motterl.parse_start(MOTTERL_PAYLOAD)
    assert start.iterations == 100 and start.batch_size == 8
    new = motterl.new_job(start, models=ModelStore(tmp_path), served_base="base-model")
    assert new.spec.base_model == "base-model" and new.spec.create_target
    assert new.spec.target_model.startswith("ft-motterl-") and new.spec.batch_size == 2
    assert new.spec.learning_rate == 0.01 and new.spec.learning_rate_warning() is not None
    assert any("'qwen-2.5-7b' is not served here" in w for w in new.warnings)
    assert new.train_rows == MOTTERL_PAYLOAD["trainingData"]
    with pytest.raises(InvalidRequest) as error:
        motterl.parse_start({**MOTTERL_PAYLOAD, "iterations": "many"})
    assert error.value.param == "iterations"


def test_remedies_from_both_doors_reach_the_spec_and_survive_the_store(tmp_path: Path) -> None:
    from artlike_server.models.store import ModelStore

    schedule = {"start": 1.2, "end": 1.0, "steps": 10}
    hyperparameters = openai_jobs.Hyperparameters.model_validate({
        "dynamic_sampling": True, "entropy_coef": 0.003, "epsilon_high": 0.4, "clip_cov_fraction": 0.02,
        "positive_advantage_weight": 0.1, "temperature_schedule": schedule,
        "entropy_control": {"target": 0.2, "max_coef": 0.05},
        "group_size_schedule": {"start": 4, "end": 8, "steps": 4},
        "learning_rate_schedule": {"start": 1e-4, "end": 2e-5, "steps": 10, "shape": "cosine", "warmup_steps": 2}})
    remedies = hyperparameters.remedies()
    assert remedies.dynamic_sampling == DynamicSampling() and remedies.train_options() == {
        "entropy_coef": 0.003, "epsilon_high": 0.4, "clip_cov_fraction": 0.02, "positive_advantage_weight": 0.1}
    assert remedies.temperature_schedule == Schedule(start=1.2, end=1.0, steps=10)
    assert remedies.entropy_control == EntropyControl(target=0.2, max_coef=0.05)  # not a train option as such
    assert openai_jobs.Hyperparameters().remedies() == RemedySettings()  # each off unless asked for
    assert openai_jobs.Hyperparameters(dynamic_sampling=False).remedies().dynamic_sampling is None

    start = motterl.parse_start({**MOTTERL_PAYLOAD, "dynamicSampling": {"max_resample_factor": 2},
                                 "temperatureSchedule": schedule, "entropyCoef": 0.01, "clipCovFraction": 0.05,
                                 "positiveAdvantageWeight": 0.2, "entropyControl": {"target": 0.1}})
    new = motterl.new_job(start, models=ModelStore(tmp_path), served_base="base-model")
    assert new.spec.remedies == RemedySettings(dynamic_sampling=DynamicSampling(max_resample_factor=2),
                                               temperature_schedule=Schedule(**schedule), entropy_coef=0.01,
                                               clip_cov_fraction=0.05, positive_advantage_weight=0.2,
                                               entropy_control=EntropyControl(target=0.1))
    assert [new.spec.iteration_settings(i).temperature for i in (0, 5, 10, 50)] == [1.2, 1.1, 1.0, 1.0]

    store = JobStore(tmp_path / "jobs")
    store.create("ftjob-r", new.spec, training_file=None, validation_file=None, suffix=None, metadata=None,
                 train_rows=new.train_rows, validation_rows=[])
    store.close()
    assert JobStore(tmp_path / "jobs").get("ftjob-r").spec == new.spec


def test_a_guide_field_reaches_the_spec_from_both_doors_and_must_name_a_rows_field(tmp_path: Path) -> None:
    from artlike_server.models.store import ModelStore

    rows = [{"prompt": "2+2?", "answer": "4"}, {"prompt": "3+3?"}]
    start = motterl.parse_start({**MOTTERL_PAYLOAD, "trainingData": rows, "guideField": "answer"})
    new = motterl.new_job(start, models=ModelStore(tmp_path), served_base="base-model")
    assert new.spec.remedies == RemedySettings(guide_field="answer")
    assert openai_jobs.Hyperparameters(guide_field="answer").remedies().guide_field == "answer"
    with pytest.raises(InvalidRequest) as error:  # a field no row has guides nothing: refused, not ignored
        motterl.new_job(motterl.parse_start({**MOTTERL_PAYLOAD, "trainingData": rows, "guideField": "anwser"}),
                        models=ModelStore(tmp_path), served_base="base-model")
    assert error.value.param == "guideField" and "'anwser'" in str(error.value)


def test_a_bad_remedy_is_a_400_naming_it_as_the_request_spelled_it(tmp_path: Path) -> None:
    from artlike_server.models.store import ModelStore

    too_hot = {"start": 3.0, "end": 1.0, "steps": 10}
    with pytest.raises(InvalidRequest) as error:
        openai_jobs.Hyperparameters(temperature_schedule=too_hot).remedies()  # type: ignore[arg-type]
    assert error.value.param == "method.reinforcement.hyperparameters.temperature_schedule"
    assert "within [0, 2]" in str(error.value)
    start = motterl.parse_start({**MOTTERL_PAYLOAD, "groupSizeSchedule": {"start": 1, "end": 8, "steps": 4}})
    with pytest.raises(InvalidRequest) as error:
        motterl.new_job(start, models=ModelStore(tmp_path), served_base="base-model")
    assert error.value.param == "groupSizeSchedule" and "within [2, 64]" in str(error.value)
    with pytest.raises(InvalidRequest) as error:
        motterl.parse_start({**MOTTERL_PAYLOAD, "temperatureSchedule": {"start": 1.0, "end": 0.5}})
    assert error.value.param == "temperatureSchedule.steps"
    start = motterl.parse_start({**MOTTERL_PAYLOAD, "positiveAdvantageWeight": -1})
    with pytest.raises(InvalidRequest) as error:
        motterl.new_job(start, models=ModelStore(tmp_path), served_base="base-model")
    assert error.value.param == "positiveAdvantageWeight"
    with pytest.raises(InvalidRequest) as error:
        motterl.parse_start({**MOTTERL_PAYLOAD, "entropyControl": {"target": 0.2, "max_coef": -1}})
    assert error.value.param == "entropyControl.max_coef"


def test_the_job_modules_doctests() -> None:
    from artlike_server.jobs import guidance, runner
    from artlike_server.jobs import spec as spec_module

    for module in (guidance, runner, spec_module):
        assert doctest.testmod(module, raise_on_error=True).attempted >= 2


def test_job_objects_validate_against_the_openai_schema(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    job = store.create("ftjob-b", spec(), training_file="file-1", validation_file=None, suffix=None,
                       metadata=None, train_rows=[{"prompt": "p"}], validation_rows=[])
    for status in ("queued", "running", "succeeded", "failed", "cancelled"):
        error = {"code": "x", "message": "m", "param": None} if status == "failed" else None
        job = store.update("ftjob-b", status=status, error=error)
        body = openai_jobs.job_object(job)
        assert_valid("FineTuningJob", body)
        assert (body["fine_tuned_model"] == "ft-x") == (status == "succeeded")
    event = store.add_event("ftjob-b", "iteration 1", type="metrics", data={"loss": 0.1})
    assert_valid("FineTuningJobEvent", openai_jobs.event_object(event))
    checkpoint = store.add_checkpoint("ftjob-b", 1, "ft-x@1", {"train_loss": 0.2, "reward_mean": 0.5})
    assert_valid("FineTuningJobCheckpoint", openai_jobs.checkpoint_object(checkpoint))
    status = motterl.status_object(store.get("ftjob-b"))
    assert status["status"] == "cancelled" and status["progress"] == 0.0


# -------------------------------------------------------------------------------------- rewards


def test_reward_values() -> None:
    assert reward_value(True, "f").value == 1.0 and reward_value(3, "f").value == 3.0
    for bad in (float("nan"), float("inf"), "1.0", None, [1]):
        score = reward_value(bad, "reward_fn")
        assert score.value == 0.0 and score.error is not None and "not a finite number" in score.error
    sample = sample_of([{"role": "assistant", "content": "a"}, {"role": "tool", "content": "t"},
                        {"role": "assistant", "content": [{"type": "text", "text": "b"}]}])
    assert sample == {"output_text": "b", "output_tools": []}


# ------------------------------------------------------------------------------------- episodes


def scripted_chat(replies: list[dict[str, Any]], seen: list[dict[str, Any]]) -> openai.AsyncOpenAI:
    """A chat endpoint that answers with the next scripted assistant message and keeps each request."""

    def handle(request: httpx.Request) -> httpx.Response:
        import json

        seen.append(json.loads(request.content))
        message = replies.pop(0)
        return httpx.Response(200, json={
            "id": "c", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "finish_reason": "tool_calls" if message.get("tool_calls") else "stop",
                         "message": {"role": "assistant", **message}}]})

    return openai.AsyncOpenAI(base_url="http://chat.test/v1", api_key="k",
                              http_client=httpx.AsyncClient(transport=httpx.MockTransport(handle)))


@pytest.fixture(scope="module")
async def sandbox(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Sandbox]:
    box = Sandbox(tmp_path_factory.mktemp("sandbox"), hidden_paths=[], limits=SandboxLimits(call_timeout_s=5))
    await box.start()
    yield box
    await box.close()


async def test_an_episode_runs_tools_in_the_sandbox_and_scores_the_answer(sandbox: Sandbox) -> None:
    source = ("def lookup(city):\n    return {'paris': 'sunny'}.get(city.lower(), 'unknown')\n\n"
              "def reward_fn(completion, **kwargs):\n"
              "    return 1.0 if kwargs['expected'] in completion[-1]['content'] else 0.0\n")
    reward = JobReward(python_reward(source, param="r"), sandbox, judge=None)
    call = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"city": "Paris"}'}}
    bad = {"id": "call_2", "type": "function", "function": {"name": "lookup", "arguments": "{nope"}}
    seen: list[dict[str, Any]] = []
    client = scripted_chat([{"content": None, "tool_calls": [call, bad]}, {"content": "It is sunny."}], seen)
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    row = PromptRow(line=1, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[tool],
                    item={"expected": "sunny"})
    episode = await run_episode(client, "m", row, reward, RolloutSettings(max_turns=3))
    assert episode.score is not None and episode.score.value == 1.0 and episode.score.error is None
    tool_messages = [m for m in episode.messages if m["role"] == "tool"]
    assert tool_messages[0] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    assert tool_messages[1]["content"].startswith("error: the arguments are not JSON")
    assert seen[1]["messages"][-2:] == [{"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                                        tool_messages[1]]
    assert seen[0]["tools"] == [tool]


async def test_multi_step_asks_next_turn_and_stops_on_none(sandbox: Sandbox) -> None:
    source = ("def next_turn(messages, **kwargs):\n"
              "    return 'again' if sum(m['role'] == 'user' for m in messages) < 3 else None\n\n"
              "def reward_fn(completion, **kwargs):\n    return float(len(completion))\n")
    reward = JobReward(python_reward(source, param="r"), sandbox, judge=None)
    seen: list[dict[str, Any]] = []
    client = scripted_chat([{"content": f"answer {i}"} for i in range(5)], seen)
    row = PromptRow(line=1, messages=[{"role": "user", "content": "go"}], tools=None, item={})
    episode = await run_episode(client, "m", row, reward, RolloutSettings(max_turns=5, multi_step=True))
    assert len(seen) == 3 and episode.score is not None and episode.score.value == 3.0
    assert [m["role"] for m in episode.completion] == ["assistant", "user", "assistant", "user", "assistant"]


async def test_a_failing_reward_scores_zero_with_the_users_traceback(sandbox: Sandbox) -> None:
    source = "def reward_fn(completion, **kwargs):\n    x = 1\n    return x / 0\n"
    reward = JobReward(python_reward(source, param="r"), sandbox, judge=None)
    score = await reward.score([{"role": "assistant", "content": "hi"}], {})
    assert score.value == 0.0 and score.error is not None
    assert "ZeroDivisionError" in score.error and "line 3" in score.error
    graded = JobReward(grader_reward({"type": "multi", "calculate_output": "0.5 * a + 0.5 * b", "graders": {
        "a": {"type": "python", "name": "a", "source": "def grade(sample, item):\n    return 1.0\n"},
        "b": {"type": "string_check", "name": "b", "input": "{{sample.output_text}}",
              "reference": "{{item.answer}}", "operation": "eq"}}}, param="g"), sandbox, judge=None)
    assert (await graded.score([{"role": "assistant", "content": "42"}], {"answer": "42"})).value == 1.0
    assert (await graded.score([{"role": "assistant", "content": "41"}], {"answer": "42"})).value == 0.5


async def test_guidance_adds_a_reference_the_reward_passes_to_groups_whose_rollouts_all_failed(
        sandbox: Sandbox) -> None:
    source = ("def reward_fn(completion, **kwargs):\n"
              "    return 1.0 if completion[-1]['content'] == kwargs['expected'] else 0.1\n")
    reward = JobReward(python_reward(source, param="r"), sandbox, judge=None)
    rows = {line: PromptRow(line=line, messages=[{"role": "user", "content": f"q{line}"}], tools=None, item=item)
            for line, item in ((1, {"expected": "4", "answer": "4"}), (2, {"expected": "6"}),
                               (3, {"expected": "8", "answer": "eight"}), (4, {"expected": "9", "answer": "9"}))}

    def group(line: int, *rewards: float) -> art.TrajectoryGroup:
        return art.TrajectoryGroup(art.Trajectory([{"role": "user", "content": f"q{line}"},
                                                   {"role": "assistant", "content": "?"}], reward=r,
                                                  metadata={"row": line}) for r in rewards)

    groups = [group(1, 0.1, 0.1), group(2, 0.1, 0.0), group(3, 0.1, 0.1), group(4, 1.0, 0.1)]
    guided = await guide_groups(groups, rows, "answer", reward, pass_threshold=0.5)
    assert [len(g) for g in guided.groups] == [3, 2, 2, 2] and guided.guided == 1
    reference = guided.groups[0].trajectories[-1]
    assert reference.reward == 1.0 and reference.metadata["guide"] is True
    assert reference.messages() == [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "4"}]
    assert guided.groups[3] is groups[3]  # a rollout passed: untouched
    assert guided.refused == ["row 2 has no 'answer'",
                              "row 3: its 'answer' was not used: it scores 0.1, under the pass threshold 0.5"]
