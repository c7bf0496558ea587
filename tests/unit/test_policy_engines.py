"""Policy engines' rules (engine/policy.py) and the pool's routing to them, with scripted stand-ins for the
engines (the fakes of test_engine_pool.py). The integration test (tests/integration/test_policy_engine.py)
runs the same rules against real vLLM engines."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
from artlike_server.engine.client import EngineRequestError
from artlike_server.engine.policy import PolicyEngines, mean_abs_diff
from artlike_server.engine.pool import EngineMember, EnginePool
from artlike_server.engine.upstream import EngineConnectionError
from safetensors.numpy import save_file

from tests.unit.test_engine_pool import BASE, FakeAnswer, FakeClient, FakeRunner


class RecordingUpstream:
    def __init__(self, client: PolicyClient) -> None:
        self.client = client

    async def post(self, path: str, body: bytes) -> FakeAnswer:
        if self.client.unreachable:
            raise EngineConnectionError("connection refused")
        self.client.bodies.append(orjson.loads(body))
        return FakeAnswer(self.client.base_url, False)


class PolicyClient(FakeClient):
    """A policy engine: its weights are whatever was last merged; its logprobs say which."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.upstream = RecordingUpstream(self)  # type: ignore[assignment]
        self.bodies: list[dict[str, Any]] = []
        self.merged: list[tuple[str | None, str]] = []
        self.weights = BASE
        self.fail_merge: Exception | None = None
        self.skew = 0.0  # added to every logprob: a merge that went wrong

    async def tokenize(self, model: str, text: str) -> list[int]:
        return [1, 2, 3, 4]

    async def merge_weights(self, adapter_path: str | None, version: str) -> None:
        self._check()
        if self.fail_merge is not None:
            raise self.fail_merge
        self.merged.append((adapter_path, version))
        self.weights = version

    async def token_logprobs(self, model: str, token_ids: list[int], start: int) -> list[float]:
        return [logprob + self.skew for logprob in fake_logprobs(self.weights, len(token_ids) - start)]


def fake_logprobs(weights: str, count: int) -> list[float]:
    return [-(len(weights) + i) / 10 for i in range(count)]


async def reference(model: str, token_ids: list[int], start: int) -> list[float]:
    return fake_logprobs(model, len(token_ids) - start)


def adapter_dir(root: Path, name: str, *, dora: bool = False) -> Path:
    """A mergeable rank-1 adapter for `model_dir`'s 2×2 `layer.weight` (or a DoRA one, which is not)."""
    path = root / name
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 1, "lora_alpha": 1,
                                                          "use_dora": dora, "bias": "none"}))
    save_file({"base_model.model.layer.lora_A.weight": np.ones((1, 2), np.float32),
               "base_model.model.layer.lora_B.weight": np.ones((2, 1), np.float32)}, path / "adapter_model.safetensors")
    return path


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    save_file({"layer.weight": np.eye(2, dtype=np.float32)}, path / "model.safetensors")
    return path


async def policy_pool(model_dir: Path) -> tuple[EnginePool, PolicyEngines, FakeClient, PolicyClient]:
    lora_client, policy_client = FakeClient("lora"), PolicyClient("policy")
    lora = EngineMember(id="local-0", kind="local", runner=FakeRunner(), client=lora_client)  # type: ignore[arg-type]
    merged = EngineMember(id="policy-0", kind="policy", runner=FakeRunner(), client=policy_client)  # type: ignore[arg-type]
    policy = PolicyEngines([merged], base_model_id=BASE, model_dir=model_dir, reference=reference)
    pool = EnginePool([lora], policy=policy, maintenance_s=3600)
    await pool.start()
    await pool._policy_start  # type: ignore[misc]  # the policy engines start beside the others
    return pool, policy, lora_client, policy_client


async def settle(policy: PolicyEngines) -> None:
    for slot in policy.slots:
        if slot.task is not None:
            await slot.task


def test_mean_abs_diff_worked_example() -> None:
    assert mean_abs_diff([-1.0, -2.0], [-1.5, -2.0]) == pytest.approx(0.25)
    with pytest.raises(ValueError):
        mean_abs_diff([-1.0], [])


async def test_the_policy_engine_serves_the_base_model_then_each_followed_step(model_dir: Path, tmp_path: Path) -> None:
    pool, policy, _lora, merged = await policy_pool(model_dir)
    assert policy.describe()[0]["holds"] == BASE
    answer = await pool.post("/v1/chat/completions", b'{"model":"base"}', model=BASE)
    assert await answer.read() == b"policy"  # the base model: the policy engine holds it, so it goes first

    step = adapter_dir(tmp_path, "step1")
    policy.follow("m", 1, step)
    await settle(policy)
    assert merged.merged == [(str(step), "m@1")]
    slot = policy.describe()[0]
    assert slot["holds"] == "m@1" and slot["syncs"] == 1 and slot["probe_diff"] == 0.0
    # The step goes to the policy engine under the name its weights are served by; the base model does not.
    answer = await pool.post("/v1/chat/completions", b'{"model":"m@1","messages":[]}', model="m@1")
    assert await answer.read() == b"policy"
    assert merged.bodies[-1] == {"model": BASE, "messages": []}
    answer = await pool.post("/v1/chat/completions", b'{"model":"base"}', model=BASE)
    assert await answer.read() == b"lora"
    answer = await pool.post("/v1/chat/completions", b'{"model":"m@0"}', model="m@0")
    assert await answer.read() == b"lora"
    await pool.stop()


async def test_another_model_is_ignored_when_the_policy_is_pinned(model_dir: Path, tmp_path: Path) -> None:
    pool, policy, _, merged = await policy_pool(model_dir)
    policy.model = "m"
    policy.follow("other", 3, adapter_dir(tmp_path, "other"))
    await settle(policy)
    assert merged.merged == [] and policy.describe()[0]["holds"] == BASE
    await pool.stop()


async def test_an_unmergeable_step_stays_lora_served_and_is_not_retried(model_dir: Path, tmp_path: Path) -> None:
    pool, policy, _, merged = await policy_pool(model_dir)
    policy.follow("m", 1, adapter_dir(tmp_path, "dora", dora=True))
    await settle(policy)
    slot = policy.describe()[0]
    assert slot["holds"] == BASE and "DoRA" in slot["refused"]["m@1"]
    assert merged.merged == []  # refused from the headers: the engine's weights were never touched
    policy.kick()
    await settle(policy)
    assert merged.merged == []
    answer = await pool.post("/v1/chat/completions", b'{"model":"m@1"}', model="m@1")
    assert await answer.read() == b"lora"
    await pool.stop()


async def test_a_merge_that_does_not_match_the_lora_engine_goes_back_to_the_base(model_dir: Path,
                                                                                 tmp_path: Path) -> None:
    pool, policy, _, merged = await policy_pool(model_dir)
    merged.skew = 0.2
    policy.follow("m", 1, adapter_dir(tmp_path, "step1"))
    await settle(policy)
    slot = policy.describe()[0]
    assert "tolerance" in slot["refused"]["m@1"]
    assert merged.merged[-1] == (None, BASE) and slot["holds"] == BASE  # back to the checkpoint's weights
    await pool.stop()


@pytest.mark.parametrize("failure", [httpx.ConnectError("refused"),
                                     EngineRequestError("POST", "/update_weights", 500, "worker died")])
async def test_an_engine_that_fails_mid_sync_holds_nothing_until_it_restarts(
        model_dir: Path, tmp_path: Path, failure: Exception) -> None:
    pool, policy, _, merged = await policy_pool(model_dir)
    merged.fail_merge = failure
    policy.follow("m", 1, adapter_dir(tmp_path, "step1"))
    await settle(policy)
    assert policy.describe()[0]["holds"] is None  # unknown weights: no request goes there
    answer = await pool.post("/v1/chat/completions", b'{"model":"base"}', model=BASE)
    assert await answer.read() == b"lora"
    # The supervisor restarts it: base weights again, then it resyncs to the target.
    merged.fail_merge = None
    merged.weights = BASE
    await policy.slots[0].member.runner.restart()
    await settle(policy)
    assert policy.describe()[0]["holds"] == "m@1"
    await pool.stop()


async def test_a_failing_policy_engine_fails_over_to_the_lora_engines(model_dir: Path) -> None:
    pool, _, _lora, merged = await policy_pool(model_dir)
    merged.unreachable = True
    answer = await pool.post("/v1/chat/completions", b'{"model":"base"}', model=BASE, replayable=True)
    assert await answer.read() == b"lora"
    assert pool.describe()[1]["failures"] == 1
    await pool.stop()


async def test_a_newer_target_during_a_sync_is_merged_right_after(model_dir: Path, tmp_path: Path) -> None:
    pool, policy, _, merged = await policy_pool(model_dir)
    step1, step2 = adapter_dir(tmp_path, "s1"), adapter_dir(tmp_path, "s2")
    policy.follow("m", 1, step1)
    policy.follow("m", 2, step2)  # while step 1's sync is under way
    await settle(policy)
    await asyncio.sleep(0)
    assert merged.merged[-1] == (str(step2), "m@2") and policy.describe()[0]["holds"] == "m@2"
    await pool.stop()


async def test_a_sync_waits_for_requests_routed_before_it_began(model_dir: Path, tmp_path: Path) -> None:
    pool, policy, _, merged = await policy_pool(model_dir)
    answer = await pool.post("/v1/chat/completions", b'{"model":"base"}', model=BASE)  # routed, still open
    policy.follow("m", 1, adapter_dir(tmp_path, "step1"))
    await asyncio.sleep(0.2)
    assert merged.merged == [] and policy.describe()[0]["holds"] is None  # out of rotation, waiting
    await answer.read()
    answer.abort()
    await settle(policy)
    assert merged.merged[-1] == (str(tmp_path / "step1"), "m@1")
    await pool.stop()


async def test_a_step_the_lora_engines_cannot_score_is_not_served_merged(model_dir: Path, tmp_path: Path) -> None:
    from artlike_server.errors import NotFound, ServiceUnavailable

    pool, policy, _, merged = await policy_pool(model_dir)
    failures: list[Exception] = [ServiceUnavailable("engines down", retry_after=1.0), NotFound("no step 1")]

    async def failing(model: str, token_ids: list[int], start: int) -> list[float]:
        raise failures.pop(0)

    policy.reference = failing
    step = adapter_dir(tmp_path, "step1")
    policy.follow("m", 1, step)
    await settle(policy)
    # Unavailable: back to the base weights, tried again at the next round...
    assert policy.describe()[0]["holds"] == BASE and "m@1" not in policy.describe()[0]["refused"]
    policy.kick()
    await settle(policy)
    # ...where the step is gone: refused, not retried.
    assert policy.describe()[0]["holds"] == BASE and "no step 1" in policy.describe()[0]["refused"]["m@1"]
    assert merged.merged == [(str(step), "m@1"), (None, BASE), (str(step), "m@1"), (None, BASE)]
    await pool.stop()


async def test_a_busy_policy_engine_spills_its_step_over_to_an_idle_lora_engine(model_dir: Path) -> None:
    pool, *_ = await policy_pool(model_dir)
    answers = [await pool.post("/v1/chat/completions", b'{"model":"base"}', model=BASE) for _ in range(17)]
    served = [await answer.read() for answer in answers]
    assert served == [b"policy"] * 16 + [b"lora"]  # the 17th found 16 in flight there and none on LoRA
    for answer in answers:
        answer.abort()
    await pool.stop()
