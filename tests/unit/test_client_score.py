"""Reward models from the client, against an in-process mock server (httpx.MockTransport): registering one,
`model.score` / `art.score` over `POST /v1/rewards` (every input kind, batching pinned to one step, errors),
training one (`train_reward_model`), and PPO trajectories that a reward model scores (no reward of their own)."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

import artlike as art
from artlike._score import MAX_INPUTS
from artlike._train import build_train_request
from artlike.types import ModelInfo, OfflineTrajectory, TrajectoryRef

SERVER = "http://artlike.test"
ANSWER = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]


class RewardsServer:
    """Answers /v1/rewards with score = the input's position in its request + 0.5, as step 3 of the model."""

    def __init__(self, *, status: int = 200) -> None:
        self.requests: list[dict[str, Any]] = []
        self.status = status

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body: dict[str, Any] = orjson.loads(request.content)
        if request.url.path == "/v1/trainable_models":
            self.requests.append(body)
            return httpx.Response(201, json=ModelInfo(
                name=body["name"], base_model=body["base_model"], lora=art.LoraConfig(), latest_step=0,
                served_name=f"{body['name']}@0", created_at=1.0, kind=body["kind"],
                reward_head=body["reward_head"]).model_dump(mode="json"))
        assert (request.method, request.url.path) == ("POST", "/v1/rewards")
        self.requests.append(body)
        if self.status != 200:
            return httpx.Response(self.status, json={"error": {
                "message": "model 'policy' is a policy, not a reward model", "type": "invalid_request_error",
                "param": "model", "code": "not_a_reward_model"}})
        name = body["model"].partition("@")[0]
        return httpx.Response(200, json={"object": "list", "model": f"{name}@3", "data": [
            {"index": i, "score": i + 0.5, "objectives": {"helpful": i + 0.5}, "tokens": 10}
            for i in range(len(body["inputs"]))]})


def reward_model(server: RewardsServer, **kwargs: Any) -> art.TrainableModel:
    return art.TrainableModel("rm", "base/model", SERVER, kind="reward", transport=httpx.MockTransport(server),
                              retry=art.RetryPolicy(max_retries=0), **kwargs)


def recorded_trajectory() -> art.Trajectory:
    return art.TrainableModel("agent", "base/model", SERVER).trajectory()


# -------------------------------------------------------------------------------------- registering


async def test_a_reward_model_registers_with_its_kind_and_head() -> None:
    server = RewardsServer()
    model = reward_model(server, reward_head=art.RewardHeadConfig(num_objectives=2,
                                                                  objective_names=["helpful", "safe"]))
    assert model.kind == "reward" and model.reward_head is not None and model.reward_head.names == ["helpful", "safe"]
    assert "kind='reward'" in repr(model)
    info = await model.register()
    assert server.requests[0]["kind"] == "reward"
    assert server.requests[0]["reward_head"]["objective_names"] == ["helpful", "safe"]
    assert info.kind == "reward"
    plain = reward_model(server)
    assert plain.reward_head == art.RewardHeadConfig()  # the default head: one objective, last-token pooling
    policy = art.TrainableModel("agent", "base/model", SERVER)
    assert (policy.kind, policy.reward_head) == ("policy", None)
    with pytest.raises(ValueError, match="reward_head is for kind 'reward'"):
        art.TrainableModel("agent", "base/model", SERVER, reward_head={"num_objectives": 2})


# --------------------------------------------------------------------------------------- scoring


async def test_model_score_sends_each_kind_of_input_in_its_wire_shape() -> None:
    server = RewardsServer()
    model = reward_model(server)
    recorded = recorded_trajectory()
    offline = art.Trajectory(ANSWER, tools=[{"type": "function", "function": {"name": "f"}}])
    scores = await model.score([recorded, offline, ANSWER, {"completion_id": 7}, {"messages": ANSWER}])
    assert [s.score for s in scores] == [0.5, 1.5, 2.5, 3.5, 4.5]
    assert [s.index for s in scores] == [0, 1, 2, 3, 4] and scores[0].objectives == {"helpful": 0.5}
    (body,) = server.requests
    assert body["model"] == "rm"
    assert body["inputs"] == [
        {"trajectory_id": recorded.id, "completion_id": None},
        {"messages": ANSWER, "tools": offline.tools},
        ANSWER,
        {"trajectory_id": None, "completion_id": 7},
        {"messages": ANSWER, "tools": None},
    ]
    await model.score([ANSWER], step=2)
    assert server.requests[-1]["model"] == "rm@2"
    assert model.score_sync([ANSWER])[0].score == 0.5


async def test_art_score_takes_a_model_or_a_name_on_a_server() -> None:
    server = RewardsServer()
    model = reward_model(server)
    assert [s.score for s in await art.score(model, [ANSWER, ANSWER])] == [0.5, 1.5]
    by_name = await art.score("rm@3", [ANSWER], server=SERVER, api_key="k", transport=httpx.MockTransport(server))
    assert by_name[0].score == 0.5 and server.requests[-1]["model"] == "rm@3"
    assert art.score_sync("rm", [ANSWER], server=SERVER, transport=httpx.MockTransport(server))[0].tokens == 10
    assert art.score_sync(model, [ANSWER])[0].score == 0.5
    with pytest.raises(TypeError, match="server="):
        await art.score("rm", [ANSWER])
    with pytest.raises(TypeError, match="own connection"):
        await art.score(model, [ANSWER], server=SERVER)


async def test_many_inputs_go_in_batches_scored_by_one_step() -> None:
    server = RewardsServer()
    scores = await reward_model(server).score([ANSWER] * (MAX_INPUTS + 2))
    assert [len(r["inputs"]) for r in server.requests] == [MAX_INPUTS, 2]
    assert [r["model"] for r in server.requests] == ["rm", "rm@3"]  # pinned to the step the first answer named
    assert [s.index for s in scores] == list(range(MAX_INPUTS + 2))
    assert scores[-1].score == 1.5  # the second batch's position 1
    assert await reward_model(server).score([]) == []


async def test_inputs_are_checked_before_any_request() -> None:
    server = RewardsServer()
    model = reward_model(server)
    failed = recorded_trajectory()
    failed.exception = RuntimeError("boom")
    with pytest.raises(ValueError, match="failed and cannot be scored"):
        await model.score([failed])
    with pytest.raises(ValueError, match="trajectory_id"):  # a dict with neither messages nor ids
        await model.score([{}])
    with pytest.raises(TypeError, match="not a string"):
        await model.score(["2+2 is 4"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="pattern"):
        await art.score("rm@x", [ANSWER], server=SERVER, transport=httpx.MockTransport(server))
    assert server.requests == []


async def test_a_server_error_is_a_typed_error() -> None:
    model = reward_model(RewardsServer(status=400))
    with pytest.raises(art.BadRequestError) as raised:
        await model.score([ANSWER])
    assert raised.value.code == "not_a_reward_model"


# -------------------------------------------------------------------------------------- training


def test_train_reward_model_builds_pairs_and_scored_examples() -> None:
    model = reward_model(RewardsServer())
    chosen, rejected = recorded_trajectory(), recorded_trajectory()
    request = model._reward_model_request(
        [(chosen, rejected), {"prompt": [ANSWER[0]], "chosen": "4", "rejected": "5"}],
        [{"messages": ANSWER, "targets": [1.0]}, art.ScoredExample(trajectory_id=chosen.id, targets=[0.25])],
        None, {"margin": 0.5, "learning_rate": 3e-5})
    assert isinstance(request.config, art.RewardModelConfig)
    assert (request.config.margin, request.config.learning_rate) == (0.5, 3e-5)
    assert len(request.pairs) == 2 and [s.targets for s in request.scored] == [[1.0], [0.25]]
    body = request.model_dump(mode="json")
    assert body["pairs"][0]["chosen_trajectory_id"] == chosen.id and body["config"]["objective"] == "reward_model"
    with pytest.raises(ValueError, match="nothing to train on"):
        model._reward_model_request([], [], None, {})
    with pytest.raises(ValueError, match="not objective 'dpo'"):
        model._reward_model_request([(chosen, rejected)], [], art.DPOConfig(), {})
    with pytest.raises(TypeError, match="either config="):
        model._reward_model_request([(chosen, rejected)], [], art.RewardModelConfig(), {"margin": 1.0})


def test_ppo_with_a_reward_model_sends_trajectories_without_a_reward() -> None:
    recorded = recorded_trajectory()
    offline = art.Trajectory(ANSWER)
    rewarded = recorded_trajectory()
    rewarded.reward = 1.0
    group = art.TrajectoryGroup([recorded, offline, rewarded])
    request = build_train_request("agent", [group], art.PPOConfig(reward_model="rm@2"))
    wire = request.groups[0].trajectories
    assert isinstance(wire[0], TrajectoryRef) and isinstance(wire[1], OfflineTrajectory)
    assert [t.reward for t in wire] == [None, None, 1.0]
    for config in (art.PPOConfig(), art.GRPOConfig()):  # no reward model: every trajectory needs its reward
        with pytest.raises(ValueError, match="has no reward"):
            build_train_request("agent", [art.TrajectoryGroup([recorded, offline])], config)
