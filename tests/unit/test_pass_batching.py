"""Which passes go to the trainer together (`training/pass_batching.py`), against a stand-in for the worker
that takes a fixed time per command: a pass never waits for others, runs whose passes queue together meet in
one command, errors reach only their own pass."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import pytest
from artlike_server.trainer_ipc import protocol
from artlike_server.training.pass_batching import PassBatcher

from artlike.types import SFTConfig

PASS_SECONDS = 0.05


def command(model: str) -> protocol.Pass:
    return protocol.Pass(model_name=model, batch_path=f"{model}.batch", config=SFTConfig())


class Trainer:
    """One command at a time under the lock; a pass command takes PASS_SECONDS and fuses all its passes
    except those of `solo` models."""

    def __init__(self, solo: frozenset[str] = frozenset(), fail: frozenset[str] = frozenset()) -> None:
        self.lock = asyncio.Lock()
        self.batches: list[list[str]] = []
        self.solo = solo
        self.fail = fail

    async def run(self, commands: Sequence[protocol.Pass]) -> list[protocol.PassDone | BaseException]:
        assert self.lock.locked()
        self.batches.append([c.model_name for c in commands])
        await asyncio.sleep(PASS_SECONDS)
        fusable = [c for c in commands if c.model_name not in self.solo | self.fail]
        return [ValueError(f"bad batch of {c.model_name}") if c.model_name in self.fail else
                protocol.PassDone(loss=0.0, tokens=1, objective="sft", metrics={}, logprobs=[], seconds=PASS_SECONDS,
                                  fused=len(fusable) if c in fusable and len(fusable) > 1 else 1)
                for c in commands]  # fmt: skip

    async def optim_step(self) -> None:
        async with self.lock:
            await asyncio.sleep(PASS_SECONDS / 10)


async def train(batcher: PassBatcher, trainer: Trainer, model: str, steps: int) -> None:
    """A run as the SDK drives it: a pass, then its optimizer step, then a short pause (the client's turn)."""
    for _ in range(steps):
        await batcher.submit(command(model))
        await trainer.optim_step()
        await asyncio.sleep(PASS_SECONDS / 10)


async def test_a_lone_model_never_waits() -> None:
    trainer = Trainer()
    batcher = PassBatcher(trainer.lock, trainer.run)
    began = time.monotonic()
    await train(batcher, trainer, "a", 6)
    assert trainer.batches == [["a"]] * 6
    assert time.monotonic() - began < 6 * PASS_SECONDS * 1.5 + 0.2  # never waited for another run
    assert (batcher.passes, batcher.fused) == (6, 0)


async def test_passes_that_queue_together_share_a_command() -> None:
    trainer = Trainer()
    batcher = PassBatcher(trainer.lock, trainer.run)
    await asyncio.gather(*(train(batcher, trainer, model, 8) for model in ("a", "b", "c")))
    assert sum(len(batch) for batch in trainer.batches) == 24
    assert all(len(set(batch)) == len(batch) for batch in trainer.batches)  # one pass per model in a command
    # Three runs alternate on one trainer: while one run's command runs, the others' passes queue up.
    assert batcher.fused >= 12, trainer.batches
    assert batcher.fused == sum(len(batch) for batch in trainer.batches if len(batch) > 1)


async def test_without_fusing_every_pass_runs_alone() -> None:
    trainer = Trainer()
    batcher = PassBatcher(trainer.lock, trainer.run, max_passes=1)
    await asyncio.gather(*(train(batcher, trainer, model, 4) for model in ("a", "b")))
    assert all(len(batch) == 1 for batch in trainer.batches) and len(trainer.batches) == 8


async def test_a_pass_never_waits_for_a_run_that_stopped() -> None:
    trainer = Trainer()
    batcher = PassBatcher(trainer.lock, trainer.run)
    await asyncio.gather(train(batcher, trainer, "a", 4), train(batcher, trainer, "b", 4))
    began = time.monotonic()
    await train(batcher, trainer, "a", 4)  # b has stopped
    assert trainer.batches[-4:] == [["a"]] * 4
    assert time.monotonic() - began < 4 * PASS_SECONDS * 1.5 + 0.2


async def test_at_most_max_passes_share_a_command() -> None:
    trainer = Trainer()
    batcher = PassBatcher(trainer.lock, trainer.run, max_passes=2)
    async with trainer.lock:  # four runs' passes and a second pass of "a" wait together
        waiting = [asyncio.ensure_future(batcher.submit(command(m))) for m in ("a", "a", "b", "c", "d")]
        await asyncio.sleep(0)
    await asyncio.gather(*waiting)
    assert trainer.batches == [["a", "b"], ["a", "c"], ["d"]]
    assert (batcher.passes, batcher.fused) == (5, 4)


async def test_an_error_reaches_only_its_own_pass() -> None:
    trainer = Trainer(fail=frozenset({"b"}))
    batcher = PassBatcher(trainer.lock, trainer.run)
    async with trainer.lock:  # both passes wait together, then go as one command
        a = asyncio.ensure_future(batcher.submit(command("a")))
        b = asyncio.ensure_future(batcher.submit(command("b")))
        await asyncio.sleep(0)
    done = await a
    with pytest.raises(ValueError, match="bad batch of b"):
        await b
    assert done.fused == 1 and trainer.batches == [["a", "b"]]


async def test_a_failed_command_fails_every_pass_in_it() -> None:
    lock = asyncio.Lock()

    async def crash(commands: Sequence[protocol.Pass]) -> list[protocol.PassDone | BaseException]:
        raise RuntimeError("the worker died")

    batcher = PassBatcher(lock, crash)
    async with lock:
        waiting = [asyncio.ensure_future(batcher.submit(command(m))) for m in ("a", "b")]
        await asyncio.sleep(0)
    results = await asyncio.gather(*waiting, return_exceptions=True)
    assert all(isinstance(r, RuntimeError) for r in results)
