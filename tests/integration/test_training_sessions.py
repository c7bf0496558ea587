"""Training sessions (`/v1/training_sessions`, `art.TrainingSession`) on the real trainer and engine.

forward_backward twice, optim_step, forward, save_state(serve): the served step's logprobs (the engine's
prompt logprobs) equal the session's forward logprobs within bf16/kernel tolerance and differ from the
starting step's. One session per model, never beside a job; bad batches are 400s that keep the session;
an idle session ends by itself; the custom GRPO loop of examples/custom_loop runs an iteration. Uses the
session fixture `server` (tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import statistics
from typing import Any
from uuid import uuid4

import httpx
import pytest
from artlike_server.launcher import ServerProcess

import artlike as art
from examples.custom_loop.grpo import train as custom_grpo

from .engine_helpers import engine_connection, engine_tokens, served_logprobs
from .helpers import async_http_client, trainable_model

pytestmark = pytest.mark.integration

PROMPT = [{"role": "user", "content": "What is the secret word?"}]
TOLERANCE = 0.05  # mean |Δ logprob| per scored token, engine (vLLM CPU kernels) vs trainer (PyTorch SDPA)


def new_model(server: ServerProcess, prefix: str) -> art.TrainableModel:
    return trainable_model(server, f"{prefix}-{uuid4().hex[:8]}", lora=art.LoraConfig(rank=8))


async def sequence(http: httpx.AsyncClient, model: str, answer: str) -> dict[str, Any]:
    """The chat `PROMPT` + `answer` as token ids (the engine's tokenization), the answer's tokens scored."""
    context = await engine_tokens(http, model, PROMPT, generation_prompt=True)
    full = await engine_tokens(http, model, [*PROMPT, {"role": "assistant", "content": answer}],
                               generation_prompt=False)
    return {"token_ids": full, "trainable": [i >= len(context) for i in range(len(full))]}


def mean_gap(a: list[float | None], b: list[float | None]) -> float:
    pairs = [(x, y) for x, y in zip(a, b, strict=True) if x is not None and y is not None]
    assert pairs
    return statistics.fmean(abs(x - y) for x, y in pairs)


async def test_primitives_train_save_and_serve_what_forward_computed(server: ServerProcess) -> None:
    model = new_model(server, "prim")
    await model.register()
    engine = engine_connection(server)
    async with (httpx.AsyncClient(base_url=engine.base_url, headers=engine.headers, timeout=120) as tokens,
                async_http_client(server, timeout=120) as http):
        batch = [await sequence(tokens, server.model_id, "The secret word is pumpernickel."),
                 await sequence(tokens, server.model_id, "It is pumpernickel, of course.")]
        async with await model.training_session(learning_rate=2e-3) as session:
            assert session.info.step == 0 and session.info.pending_passes == 0
            first = await session.forward_backward(batch[:1], loss="cross_entropy")
            second = session.forward_backward_async(batch[1:], loss="cross_entropy")  # queued in order
            assert (await second).pending_passes == 2 and first.objective == "sft" and first.tokens > 5
            served_before = await served_logprobs(http, f"{model.name}@0", batch[0]["token_ids"])
            assert mean_gap(first.sequences[0].logprobs, served_before) < TOLERANCE  # the same weights
            step = await session.optim_step()
            assert step.grad_norm > 0 and step.optimizer_steps == 1
            after = await session.forward(batch)
            assert after.loss < first.loss
            saved = await session.save_state(serve=True)
            assert saved.model == f"{model.name}@1" and saved.served
            for index, row in enumerate(batch):
                served = await served_logprobs(http, saved.model, row["token_ids"])
                assert mean_gap(after.sequences[index].logprobs, served) < TOLERANCE
                assert mean_gap(served, await served_logprobs(http, f"{model.name}@0", row["token_ids"])) > 0.3

            # One session per model, and no job beside it; mistakes are 400s that keep the session.
            with pytest.raises(art.ConflictError, match="session"):
                await model.training_session()
            pairs = [{"prompt": PROMPT, "chosen": "yes", "rejected": "no"}]
            with pytest.raises(art.ConflictError, match="session"):
                await model.train_dpo(pairs, progress=False)
            health = (await http.get("/health")).json()
            assert health["training_sessions"][model.name] == session.id
            with pytest.raises(art.BadRequestError, match="vocabulary"):
                await session.forward_backward([{"token_ids": [1, 10**8]}])
            with pytest.raises(art.ConflictError, match="forward_backward first"):
                await session.optim_step()
            assert (await session.refresh()).pending_passes == 0
            again = await session.forward(batch[:1])
            assert mean_gap(again.sequences[0].logprobs, after.sequences[0].logprobs) < 1e-3
        assert session.info.status == "ended"
    with pytest.raises(art.NotFoundError):
        await session.refresh()

    # A session on a saved step continues it; load_state goes back to another.
    async with await model.training_session(from_step=1) as resumed:
        assert resumed.info.step == 1
        await resumed.load_state(0)
        fresh = await resumed.forward(batch[:1])
        assert mean_gap(fresh.sequences[0].logprobs, first.sequences[0].logprobs) < 1e-3


async def test_an_idle_session_ends_by_itself(server: ServerProcess) -> None:
    model = new_model(server, "idle")
    await model.register()
    session = await model.training_session(idle_timeout_s=5)
    # The server looks every 5 s: the session ends 5-10 s from now. Looking at it is not using it.
    deadline = asyncio.get_running_loop().time() + 15
    with pytest.raises(art.NotFoundError, match="timed out"):
        while True:
            await session.refresh()
            assert asyncio.get_running_loop().time() < deadline, "the idle session was never ended"
            await asyncio.sleep(0.5)
    # At once, no retry: the session leaves in the same step its model is freed, so the 404 means it is free.
    async with await model.training_session():
        pass


async def test_the_custom_grpo_loop_example(server: ServerProcess) -> None:
    model = new_model(server, "loop")
    await model.register()
    samplers = await custom_grpo(model, iterations=2, group_size=4, questions=2)
    info = await model.get_info()
    assert samplers[0] == f"{model.name}@0" and samplers[-1] == f"{model.name}@{info.latest_step}"
    # A step per iteration that had a group with different rewards (none when all were equal: no signal).
    assert [s.step for s in info.steps] == list(range(info.latest_step + 1))
