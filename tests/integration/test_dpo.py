"""DPO through `/_train_model` (objective "dpo") on the real trainer and engine.

Pairs of one kind (agree to help, politely, over refusing) train a step of two gradient steps: the first
starts at zero margin (the policy starts equal to its reference) and the second sees a larger one. A second
job on recorded pairs uses the trained step as its reference (`reference: "name@1"`): its first step starts
at zero rewards again. Pairs the trainer cannot use are refused before any work.

Learning evidence (`make test-learning`): after three epochs, on held-out pairs of the same kind, scored by
the served step's own prompt logprobs, the chosen-minus-rejected logprob margin rises and `reward_accuracy`
rises from 0. Uses the session fixture `server` (tests/conftest.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from uuid import uuid4

import httpx
import pytest
from artlike_server.launcher import ServerProcess

import artlike as art

from .engine_helpers import engine_connection, engine_tokens, served_logprobs
from .helpers import async_http_client, trainable_model

pytestmark = pytest.mark.integration

TASKS = ["my homework", "a cover letter", "my garden", "a birthday speech", "my tax form", "a bug in my code",
         "a recipe", "my bike", "a poem", "a travel plan"]
HELD_OUT = ["my resume", "a science project", "a wedding toast", "my budget"]


def pair(task: str) -> dict[str, Any]:
    return {"prompt": [{"role": "user", "content": f"Can you help me with {task}?"}],
            "chosen": f"Yes, gladly! Let us work on {task} together.",
            "rejected": f"No. I will not help you with {task}."}


@dataclass
class Scorer:
    """Scores answers under a served step: the engine tokenizes (with the base model's template), the artlike
    server (which loads an evicted step on demand) returns the prompt logprobs."""

    engine: httpx.AsyncClient
    server: httpx.AsyncClient
    base_model: str

    async def answer_logprob(self, model: str, prompt: list[dict[str, Any]], answer: str) -> float:
        """log π(answer | prompt) under the served `model`."""
        context = await engine_tokens(self.engine, self.base_model, prompt, generation_prompt=True)
        full = await engine_tokens(self.engine, self.base_model, [*prompt, {"role": "assistant", "content": answer}],
                                   generation_prompt=False)
        assert full[: len(context)] == context
        scored = await served_logprobs(self.server, model, full)
        return sum(value for value in scored[len(context):] if value is not None)

    async def held_out_margin(self, model: str) -> float:
        margins = []
        for task in HELD_OUT:
            p = pair(task)
            margins.append(await self.answer_logprob(model, p["prompt"], p["chosen"])
                           - await self.answer_logprob(model, p["prompt"], p["rejected"]))
        return sum(margins) / len(margins)


async def test_dpo_trains_on_written_pairs_then_on_recorded_pairs_against_a_step(server: ServerProcess) -> None:
    model = trainable_model(server, f"dpo-{uuid4().hex[:8]}", lora=art.LoraConfig(rank=8))
    await model.register()
    result = await model.train_dpo([pair(task) for task in TASKS], beta=0.1, learning_rate=3e-4, epochs=1,
                                   gradient_steps_per_epoch=2, progress=False)
    assert result.trained and result.step == 1
    steps = result.metrics
    assert len(steps) == 2 and all(s.objective == "dpo" for s in steps)
    first, second = steps[0].metrics, steps[1].metrics
    assert first["reward_accuracy"] == 0.0 and abs(first["reward_margin"]) < 1e-3  # policy == reference
    assert second["reward_margin"] > first["reward_margin"], (first, second)  # the first step moved toward chosen

    # Recorded pairs (their exact sampled tokens), with the trained step as the reference.
    recorded = []
    for task in HELD_OUT[:2]:
        answers = []
        for temperature in (0.0, 1.5):  # two different answers to one prompt
            async with model.trajectory() as t:
                await t.async_openai_client().chat.completions.create(
                    model=model.name, messages=pair(task)["prompt"], temperature=temperature, max_tokens=12,
                    seed=7)  # type: ignore[arg-type]
            answers.append(t)
        recorded.append((answers[0], answers[1]))
    again = await model.train_dpo(recorded, reference=f"{model.name}@1", learning_rate=1e-4, progress=False)
    assert again.trained and again.step == 2
    assert abs(again.metrics[0].metrics["reward_margin"]) < 1e-3  # step 1 is both the policy and the reference


@pytest.mark.learning
async def test_dpo_prefers_the_chosen_kind_on_held_out_pairs(capable_server: ServerProcess) -> None:
    server = capable_server  # learning evidence is about the embedded model: the full one
    model = trainable_model(server, f"dpo-{uuid4().hex[:8]}", lora=art.LoraConfig(rank=8))
    await model.register()
    engine = engine_connection(server)
    async with (httpx.AsyncClient(base_url=engine.base_url, headers=engine.headers, timeout=120) as tokens,
                async_http_client(server, timeout=120) as http):
        scorer = Scorer(tokens, http, server.model_id)
        before = await scorer.held_out_margin(f"{model.name}@0")
        result = await model.train_dpo([pair(task) for task in TASKS], beta=0.1, learning_rate=3e-4, epochs=3,
                                       gradient_steps_per_epoch=2, progress=False)
        assert result.trained and result.step == 1
        last = result.metrics[-1].metrics
        assert last["reward_accuracy"] >= 0.8 and last["reward_margin"] > 0.05, last
        after = await scorer.held_out_margin(f"{model.name}@1")
    assert after > before + 1.0, (before, after)


async def test_pairs_dpo_cannot_use_are_refused(server: ServerProcess) -> None:
    model = trainable_model(server, f"dpo-bad-{uuid4().hex[:8]}")
    await model.register()
    same = []
    for _ in range(2):  # greedy: the same tokens twice, under two trajectory ids
        async with model.trajectory() as t:
            await t.async_openai_client().chat.completions.create(
                model=model.name, messages=[{"role": "user", "content": "Say yes."}], temperature=0, max_tokens=4)
        same.append(t)
    async with async_http_client(server, timeout=60) as http:
        cases = [
            ({"pairs": [{"chosen_trajectory_id": same[0].id, "rejected_trajectory_id": same[1].id}]},
             "pairs[0]", "invalid_pair"),
            ({"pairs": [pair("a poem")], "groups": [{"trajectories": [{"trajectory_id": same[0].id, "reward": 1}]}]},
             "groups", None),
            ({}, "pairs", None),
            ({"pairs": [{**pair("a poem"), "rejected": [{"role": "user", "content": "hm"}]}]}, "pairs.0", None),
        ]
        for body, param, code in cases:
            reply = await http.post("/_train_model", json={"model": model.name, "config": {"objective": "dpo"},
                                                           **body})
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert error["param"] == param, error
            if code is not None:
                assert error["code"] == code, error
        reply = await http.post("/_train_model", json={"model": model.name, "pairs": [pair("a poem")],
                                                       "config": {"objective": "dpo", "reference": f"{model.name}@9"}})
        assert reply.status_code == 404 and reply.json()["error"]["param"] == "config.reference", reply.text
        steps = await http.get(f"/v1/trainable_models/{model.name}/steps")
        assert [s["step"] for s in steps.json()["data"]] == [0]  # nothing was trained
