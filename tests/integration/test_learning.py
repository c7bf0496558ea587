"""The default model learns: three GRPO steps move its sampled behaviour where the reward points, on held-out prompts.

The task is deliberately simple and its reward dense: yes/no questions, reward 1 when the answer starts with
"yes". The base model says "yes" to about a third of them, so almost every group of 8 samples carries
signal, and the policy moves within a few steps (measured on a 2-core CPU: held-out 0.25-0.38 before, 0.97-1.0
after three steps). A sign error anywhere in advantages, loss or ratio would push it the
other way. Rollouts go through the official `openai` client and trajectory URLs; held-out questions are
never trained on and are sampled from step 0 before and from the final step after. `make demo` runs the
longer arithmetic job (accuracy from the answer checked by code).

Learning evidence (`make test-learning`): the suite proves the mechanics of a step elsewhere, and the sign of
the objective in its unit tests (tests/unit/test_grpo.py, test_objectives.py and the TRL parity test).
"""

from __future__ import annotations

import asyncio
import uuid

import orjson
import pytest
from artlike_server.launcher import ServerProcess

from .helpers import async_http_client, async_openai_client

pytestmark = [pytest.mark.integration, pytest.mark.learning]


@pytest.fixture(scope="module")
def server(capable_server: ServerProcess) -> ServerProcess:
    """Learning evidence is about the embedded model: the full one (tests/conftest.py)."""
    return capable_server

STEPS = 3
SAMPLES = 8
MAX_TOKENS = 8
LEARNING_RATE = 5e-4
INSTRUCTION = "Answer with yes or no. "
TRAIN = ["Is water wet?", "Can cats fly?", "Is the moon made of cheese?", "Do fish swim?",
         "Is fire cold?", "Are apples fruit?", "Is ice hot?", "Do birds have wings?"]  # fmt: skip
HELD_OUT = ["Is grass green?", "Can dogs talk?", "Is the sun a star?", "Do rocks eat?"]


def reward(text: str) -> float:
    return 1.0 if text.strip().lower().startswith("yes") else 0.0


async def sample(server: ServerProcess, model: str, question: str, trajectory_id: str | None = None) -> float:
    async with async_openai_client(server, trajectory_id, max_retries=2, timeout=300) as client:
        completion = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": INSTRUCTION + question}], max_tokens=MAX_TOKENS,
            temperature=1.0)  # fmt: skip
    return reward(completion.choices[0].message.content or "")


async def held_out_reward(server: ServerProcess, model: str, samples: int = SAMPLES) -> float:
    rewards = await asyncio.gather(*(sample(server, model, q) for q in HELD_OUT for _ in range(samples)))
    return sum(rewards) / len(rewards)


async def test_reward_rises_within_a_few_steps(server: ServerProcess) -> None:
    name = "learner"
    async with async_http_client(server, timeout=600) as http:
        response = await http.post(f"{server.base_url}/v1/trainable_models",
                                   json={"name": name, "base_model": server.model_id, "lora": {"rank": 8}})
        assert response.status_code in (200, 201), response.text
        before = await held_out_reward(server, f"{name}@0")

        step_rewards = []
        for step in range(STEPS):
            questions = (TRAIN * 2)[4 * step:4 * step + 4]
            ids = [[uuid.uuid4().hex for _ in range(SAMPLES)] for _ in questions]
            rewards = await asyncio.gather(*(sample(server, name, q, tid)
                                             for q, group in zip(questions, ids, strict=True) for tid in group))
            groups = [{"trajectories": [{"trajectory_id": tid, "reward": rewards[g * SAMPLES + i]}
                                        for i, tid in enumerate(group)]} for g, group in enumerate(ids)]
            step_rewards.append(sum(rewards) / len(rewards))
            body = {"model": name, "groups": groups, "config": {"learning_rate": LEARNING_RATE}}
            response = await http.post(f"{server.base_url}/_train_model", json=body)
            if response.status_code == 400 and response.json()["error"]["code"] == "no_signal":
                continue  # every group tied (all "yes" already): reported, not an error
            assert response.status_code == 200, response.text
            last = orjson.loads(response.content.splitlines()[-1])
            assert last["type"] == "done", last

    after = await held_out_reward(server, name)
    print(f"held-out reward: before {before:.3f}, after {after:.3f}; sampled per step {step_rewards}")
    assert after >= before + 0.3 and after >= 0.6, (before, after, step_rewards)
