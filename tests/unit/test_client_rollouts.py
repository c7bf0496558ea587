"""Trajectories, groups and `gather_trajectory_groups` on the client: ids and URLs, OpenAI clients,
failed rollouts and the `max_exceptions` policy, and offline trajectories built from `Choice` objects.
No server is involved: rollouts here are plain coroutines."""

from __future__ import annotations

import asyncio
import inspect
import logging
import re

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice

import artlike as art
from artlike._gather import exception_budget
from artlike._train import build_train_request
from artlike.types import TRAJECTORY_ID_PATTERN, GRPOConfig, OfflineTrajectory, TrajectoryRef

SERVER = "http://gpu-box:8000"


@pytest.fixture
def model() -> art.TrainableModel:
    return art.TrainableModel("agent", "base/model", SERVER + "/", api_key="")


# ------------------------------------------------------------------------------------ trajectories


def test_a_trajectory_carries_its_id_in_the_base_url(model: art.TrainableModel) -> None:
    first, second = model.trajectory(), model.trajectory(metadata={"task": 7})
    assert first.id is not None and re.fullmatch(TRAJECTORY_ID_PATTERN, first.id)
    assert first.base_url == f"{SERVER}/t/{first.id}/v1"
    assert first.model == "agent"
    assert first.id != second.id
    assert second.metadata == {"task": 7}
    assert first.recorded and not first.failed and first.reward is None


async def test_openai_clients_point_at_the_trajectory_and_close_with_the_block(model: art.TrainableModel) -> None:
    async with model.trajectory() as t:
        client, sync_client = t.async_openai_client(), t.openai_client(timeout=5.0)
        assert str(client.base_url) == f"{t.base_url}/"
        assert client.api_key == t.api_key == "artlike"  # the SDK requires a key; this server has none
        assert client.max_retries == art.RetryPolicy().max_retries
        assert sync_client.timeout == 5.0
    assert client.is_closed() and sync_client.is_closed()


def test_openai_clients_carry_the_api_key() -> None:
    model = art.TrainableModel("agent", "base/model", SERVER, api_key="sk-secret")
    with model.trajectory() as t:
        assert t.openai_client().api_key == "sk-secret"


async def test_an_exception_in_the_block_marks_the_trajectory_failed(model: art.TrainableModel) -> None:
    async with model.trajectory() as t:
        raise ValueError("tool call could not be parsed")
    assert t.failed
    assert isinstance(t.exception, ValueError)
    with model.trajectory() as sync_t:
        raise KeyError("missing")
    assert isinstance(sync_t.exception, KeyError)


async def test_cancellation_and_interrupts_are_not_captured(model: art.TrainableModel) -> None:
    with pytest.raises(asyncio.CancelledError):
        async with model.trajectory() as t:
            raise asyncio.CancelledError
    assert not t.failed
    with pytest.raises(KeyboardInterrupt), model.trajectory():
        raise KeyboardInterrupt


def test_an_offline_trajectory_has_no_base_url() -> None:
    offline = art.Trajectory([{"role": "user", "content": "hi"}], reward=1.0)
    assert not offline.recorded
    for use in (lambda: offline.base_url, lambda: offline.id, offline.openai_client, offline.get_record_sync):
        with pytest.raises(RuntimeError, match="offline trajectory"):
            use()


def test_a_recorded_trajectory_refuses_messages(model: art.TrainableModel) -> None:
    t = model.trajectory()
    t.reward = 1.0
    t.messages_and_choices.append({"role": "assistant", "content": "hi"})
    with pytest.raises(ValueError, match="offline trajectories"):
        build_train_request("agent", [[t]], GRPOConfig())


# ------------------------------------------------------------------------------ offline conversion


def vllm_completion(content: str, token_ids: list[int], logprobs: list[float]) -> ChatCompletion:
    """A chat completion as vLLM returns it with `logprobs` and `return_token_ids` on."""
    return ChatCompletion.model_validate({
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "agent",
        "prompt_token_ids": [1, 2, 3],
        "choices": [{
            "index": 0, "finish_reason": "stop", "token_ids": token_ids,
            "message": {"role": "assistant", "content": content},
            "logprobs": {"content": [{"token": f"t{i}", "logprob": lp, "bytes": None, "top_logprobs": []}
                                     for i, lp in enumerate(logprobs)]},
        }],
    })


def test_a_vllm_choice_becomes_an_assistant_message_with_its_tokens_and_logprobs() -> None:
    choice = vllm_completion("4", token_ids=[19, 2], logprobs=[-0.25, -0.5]).choices[0]
    assert art.choice_to_message(choice) == {"role": "assistant", "content": "4", "token_ids": [19, 2],
                                             "logprobs": [-0.25, -0.5]}


def test_a_choice_without_token_ids_keeps_only_the_message() -> None:
    choice = Choice.model_validate({"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 1}"}}]}})
    assert art.choice_to_message(choice) == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 1}"}}]}


def test_token_ids_and_logprobs_of_different_lengths_are_refused() -> None:
    choice = vllm_completion("4", token_ids=[19, 2], logprobs=[-0.25]).choices[0]
    with pytest.raises(ValueError, match="2 token_ids but 1 logprobs"):
        art.choice_to_message(choice)


def test_an_offline_trajectory_trains_on_explicit_messages_and_choices() -> None:
    choice = vllm_completion("4", token_ids=[19, 2], logprobs=[-0.25, -0.5]).choices[0]
    offline = art.Trajectory(
        messages_and_choices=[{"role": "user", "content": "2+2?"}, choice,
                              {"role": "user", "content": "and 3+3?"},
                              ChatCompletionMessage(role="assistant", content="6")],
        reward=1.0, metrics={"correct": 1.0},
    )
    other = art.Trajectory([{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "5"}], reward=0.0)
    request = build_train_request("agent", [art.TrajectoryGroup([offline, other])], GRPOConfig())
    first = request.groups[0].trajectories[0]
    assert isinstance(first, OfflineTrajectory)
    assert first.messages == [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "token_ids": [19, 2], "logprobs": [-0.25, -0.5]},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "6"},
    ]
    assert (first.reward, first.metrics) == (1.0, {"correct": 1.0})


def test_items_of_other_types_are_refused() -> None:
    with pytest.raises(TypeError, match="messages_and_choices items"):
        art.Trajectory(["just a string"], reward=1.0).messages()  # type: ignore[list-item]


# ----------------------------------------------------------------------------------------- gather


def make_rollout(model: art.TrainableModel, log: list[str] | None = None):  # type: ignore[no-untyped-def]
    """`rollout(reward, fail=...)`: the README snippet's shape, without a server."""

    async def rollout(reward: float, *, fail: str | None = None, delay: float = 0.0) -> art.Trajectory:
        async with model.trajectory() as t:
            try:
                await asyncio.sleep(delay)
            except asyncio.CancelledError:
                if log is not None:
                    log.append("cancelled")
                raise
            if fail == "inside":
                raise RuntimeError(f"agent failed at reward {reward}")
            t.reward = reward
        if fail == "outside":
            raise ConnectionError("rollout failed before it returned")
        return t

    return rollout


async def test_gather_resolves_the_design_snippets_generator_of_coroutines(model: art.TrainableModel) -> None:
    rollout = make_rollout(model)
    groups = await art.gather_trajectory_groups(
        (art.TrajectoryGroup(rollout(task + i / 10) for i in range(4)) for task in range(3)), progress=False)
    assert [group.rewards for group in groups] == [[task + i / 10 for i in range(4)] for task in range(3)]
    assert all(isinstance(t, art.Trajectory) and t.recorded for group in groups for t in group)


async def test_by_default_the_first_failure_is_raised_and_the_rest_cancelled(model: art.TrainableModel) -> None:
    log: list[str] = []
    rollout = make_rollout(model, log)
    group = art.TrajectoryGroup([rollout(1.0, fail="inside"), rollout(0.0, delay=30), rollout(0.5, delay=30)])
    with pytest.raises(RuntimeError, match="agent failed") as raised:
        await art.gather_trajectory_groups([group], progress=False)
    assert log == ["cancelled", "cancelled"]
    assert "1 of 3 rollouts failed, more than max_exceptions=0 allows" in raised.value.__notes__[0]


async def test_within_max_exceptions_failed_trajectories_are_dropped_from_their_group(
    model: art.TrainableModel,
) -> None:
    rollout = make_rollout(model)
    groups = await art.gather_trajectory_groups([
        art.TrajectoryGroup([rollout(1.0), rollout(0.0, fail="inside"), rollout(0.5), rollout(0.2, fail="outside")]),
        art.TrajectoryGroup([rollout(0.3), rollout(0.7)]),
    ], max_exceptions=2, progress=False)
    assert [group.rewards for group in groups] == [[1.0, 0.5], [0.3, 0.7]]
    assert sorted(type(error).__name__ for error in groups[0].exceptions) == ["ConnectionError", "RuntimeError"]
    assert groups[1].exceptions == []


async def test_a_fractional_max_exceptions_is_a_share_of_all_rollouts(model: art.TrainableModel) -> None:
    rollout = make_rollout(model)

    def groups(failures: int) -> list[art.TrajectoryGroup]:
        rewards = [float(i) for i in range(8)]
        return [art.TrajectoryGroup(rollout(r, fail="inside" if i < failures else None) for i, r in enumerate(rewards))]

    kept = await art.gather_trajectory_groups(groups(2), max_exceptions=0.25, progress=False)
    assert len(kept[0].trajectories) == 6
    with pytest.raises(RuntimeError, match="agent failed"):
        await art.gather_trajectory_groups(groups(3), max_exceptions=0.25, progress=False)


async def test_a_group_left_with_one_trajectory_is_dropped_with_a_warning(
    model: art.TrainableModel, caplog: pytest.LogCaptureFixture
) -> None:
    rollout = make_rollout(model)

    def groups() -> list[art.TrajectoryGroup]:
        return [art.TrajectoryGroup([rollout(1.0), rollout(0.0, fail="inside")]),
                art.TrajectoryGroup([rollout(0.0), rollout(1.0)])]

    with caplog.at_level(logging.WARNING, logger="artlike"):
        kept = await art.gather_trajectory_groups(groups(), max_exceptions=1, progress=False)
    assert [group.rewards for group in kept] == [[0.0, 1.0]]
    assert "dropped 1 of 2 groups left with fewer than 2 trajectories" in caplog.text
    kept = await art.gather_trajectory_groups(groups(), max_exceptions=1, min_group_size=1, progress=False)
    assert [group.rewards for group in kept] == [[1.0], [0.0, 1.0]]


async def test_concurrency_caps_the_rollouts_running_at_once(model: art.TrainableModel) -> None:
    running = peak = 0

    async def rollout(reward: float) -> art.Trajectory:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.01)
        running -= 1
        return art.Trajectory([{"role": "assistant", "content": "x"}], reward=reward)

    groups = await art.gather_trajectory_groups(
        [art.TrajectoryGroup(rollout(float(i)) for i in range(6)) for _ in range(2)], concurrency=3, progress=False)
    assert peak == 3
    assert sum(len(group.trajectories) for group in groups) == 12


async def test_rollouts_never_started_are_closed_so_python_does_not_warn_never_awaited(
    model: art.TrainableModel,
) -> None:
    rollout = make_rollout(model)
    waiting = [rollout(1.0) for _ in range(5)]
    with pytest.raises(RuntimeError):
        await art.gather_trajectory_groups([art.TrajectoryGroup([rollout(0.0, fail="inside"), *waiting])],
                                           concurrency=1, progress=False)
    assert [inspect.getcoroutinestate(coroutine) for coroutine in waiting] == [inspect.CORO_CLOSED] * 5


async def test_a_rollout_that_returns_something_else_is_a_type_error(model: art.TrainableModel) -> None:
    async def rollout() -> art.Trajectory:
        return "a string"  # type: ignore[return-value]

    with pytest.raises(TypeError, match=r"must return an artlike\.Trajectory"):
        await art.gather_trajectory_groups([art.TrajectoryGroup([rollout()])], progress=False)


async def test_the_progress_bar_shows_the_live_mean_reward(
    model: art.TrainableModel, capsys: pytest.CaptureFixture[str]
) -> None:
    rollout = make_rollout(model)
    await art.gather_trajectory_groups([art.TrajectoryGroup(rollout(r) for r in (0.0, 1.0, 0.0, 1.0))],
                                       max_exceptions=1)
    err = capsys.readouterr().err
    assert "4/4" in err and "reward=0.500" in err


async def test_finished_trajectories_pass_through_gather(model: art.TrainableModel) -> None:
    done = [art.Trajectory([{"role": "assistant", "content": "a"}], reward=r) for r in (0.0, 1.0)]
    [group] = await art.gather_trajectory_groups([art.TrajectoryGroup(done)], progress=False)
    assert group.trajectories == done


def test_exception_budget() -> None:
    assert [exception_budget(0, 64), exception_budget(3, 64), exception_budget(0.1, 64)] == [0, 3, 6]
    assert exception_budget(1.0, 64) == 64
    with pytest.raises(TypeError):
        exception_budget(True, 64)
    for bad in (-1, 1.5, -0.1):
        with pytest.raises(ValueError):
            exception_budget(bad, 64)


def test_a_group_holds_trajectories_or_awaitables_only() -> None:
    with pytest.raises(TypeError, match="Trajectory objects or awaitables"):
        art.TrajectoryGroup([{"role": "user", "content": "hi"}])  # type: ignore[list-item]


def test_failed_and_unscored_trajectories_in_a_hand_built_group(model: art.TrainableModel) -> None:
    scored, failed = model.trajectory(), model.trajectory()
    scored.reward = 1.0
    with failed:
        raise RuntimeError("boom")
    request = build_train_request("agent", [art.TrajectoryGroup([scored, failed])], GRPOConfig())
    assert request.groups[0].trajectories == [TrajectoryRef(trajectory_id=scored.id, reward=1.0)]
    with pytest.raises(ValueError, match="all 1 trajectories failed"):
        build_train_request("agent", [[failed]], GRPOConfig())


async def test_an_already_failed_trajectory_counts_before_any_rollout_starts(model: art.TrainableModel) -> None:
    failed = model.trajectory()
    with failed:
        raise RuntimeError("failed before gather")
    waiting = [make_rollout(model)(1.0) for _ in range(3)]
    with pytest.raises(RuntimeError, match="failed before gather"):
        await art.gather_trajectory_groups([art.TrajectoryGroup([failed, *waiting])], progress=False)
    assert [inspect.getcoroutinestate(coroutine) for coroutine in waiting] == [inspect.CORO_CLOSED] * 3
