"""Supervised fine-tuning through `/_train_model` (objective "sft") on the real trainer: a few steps make
the greedy answer to a prompt the target answer it did not give before; a recorded trajectory trains as an
example too. Uses the session fixture `server` (tests/conftest.py)."""

from __future__ import annotations

from uuid import uuid4

import pytest
from artlike_server.launcher import ServerProcess

import artlike as art

from .helpers import trainable_model

pytestmark = pytest.mark.integration

PROMPT = [{"role": "system", "content": "You are a helpful assistant."},
          {"role": "user", "content": "What is the password of the lighthouse?"}]
TARGET = "The password is marmalade-42."
# Enough steps at a rate low enough for a smooth descent that the answer's end (<|im_end|>) is learned with a
# clear margin, not only its words: greedy stops there on every machine's rounding.
EPOCHS = 20


async def greedy(model: art.TrainableModel, name: str) -> str:
    async with model.trajectory() as t:
        reply = await t.async_openai_client().chat.completions.create(
            model=name, messages=PROMPT, temperature=0, max_tokens=16)  # type: ignore[arg-type]
    assert t.exception is None, t.exception
    return reply.choices[0].message.content or ""


async def test_sft_teaches_the_greedy_answer(server: ServerProcess) -> None:
    model = trainable_model(server, f"sft-{uuid4().hex[:8]}", lora=art.LoraConfig(rank=8))
    await model.register()
    before = await greedy(model, model.name)
    assert before != TARGET

    async with model.trajectory() as recorded:  # a recorded example: its exact sampled tokens are targets
        await recorded.async_openai_client().chat.completions.create(
            model=model.name, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8)
    example = [*PROMPT, {"role": "assistant", "content": TARGET}]
    result = await model.train_sft([example, recorded], epochs=EPOCHS, learning_rate=5e-3, warmup_steps=1,
                                   progress=False)
    assert result.trained and result.step == 1
    steps = result.metrics
    assert len(steps) == EPOCHS and all(s.objective == "sft" for s in steps)
    assert steps[-1].metrics["nll"] < steps[0].metrics["nll"] / 4  # the targets became likely
    assert steps[0].learning_rate < steps[1].learning_rate  # warmup, then cosine decay
    assert steps[-1].learning_rate < steps[1].learning_rate
    assert await greedy(model, model.name) == TARGET
