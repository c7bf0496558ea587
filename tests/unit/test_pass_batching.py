"""Which passes go to the trainer together (`training/pass_batching.py`), against a stand-in for the worker
that takes a fixed time per command: a lone model never waits, two runs that alternate passes and optimizer
steps meet in one command, a partner that stops costs one window, errors reach only their own pass."""

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


def batcher_for(trainer: Trainer, **options: float) -> PassBatcher:
    return PassBatcher(trainer.lock, trainer.run, window_fraction=options.get("window_fraction", 1.0),
                       max_window_s=options.get("max_window_s", 1.0))


async def test_a_lone_model_never_waits() -> None:
    trainer = Trainer()
    batcher = batcher_for(trainer)
    began = time.monotonic()
    await train(batcher, trainer, "a", 6)
    assert trainer.batches == [["a"]] * 6
    assert time.monotonic() - began < 6 * PASS_SECONDS * 1.5 + 0.2  # no window was waited
    assert (batcher.passes, batcher.fused) == (6, 0)


async def test_runs_that_alternate_meet_in_one_command() -> None:
    trainer = Trainer()
    batcher = batcher_for(trainer)
    await asyncio.gather(*(train(batcher, trainer, model, 8) for model in ("a", "b", "c")))
    shared = [batch for batch in trainer.batches if len(batch) > 1]
    assert sum(len(batch) for batch in trainer.batches) == 24
    assert len(shared) >= len(trainer.batches) - 3, trainer.batches  # all but the first few
    assert batcher.fused >= 18


async def test_without_fusing_every_pass_runs_alone() -> None:
    trainer = Trainer()
    batcher = PassBatcher(trainer.lock, trainer.run, max_passes=1)
    await asyncio.gather(*(train(batcher, trainer, model, 4) for model in ("a", "b")))
    assert all(len(batch) == 1 for batch in trainer.batches) and len(trainer.batches) == 8


async def test_a_partner_that_stops_costs_at_most_one_window() -> None:
    trainer = Trainer()
    batcher = batcher_for(trainer, window_fraction=4.0)  # a window of four passes: easy to see
    await asyncio.gather(train(batcher, trainer, "a", 4), train(batcher, trainer, "b", 4))
    began = time.monotonic()
    await train(batcher, trainer, "a", 4)  # b has stopped
    assert trainer.batches[-4:] == [["a"]] * 4
    window = 4 * PASS_SECONDS
    assert time.monotonic() - began < window + 4 * PASS_SECONDS * 1.5 + 0.2


async def test_a_model_whose_passes_do_not_fuse_is_not_waited_for() -> None:
    trainer = Trainer(solo=frozenset({"d"}))
    batcher = batcher_for(trainer, window_fraction=4.0)
    began = time.monotonic()
    await asyncio.gather(train(batcher, trainer, "a", 4), train(batcher, trainer, "d", 4))
    # Eight passes and at most the one window before d was known not to fuse.
    assert time.monotonic() - began < 4 * PASS_SECONDS + 8 * PASS_SECONDS * 1.5 + 0.3
    assert batcher.fused == 0


async def test_an_error_reaches_only_its_own_pass() -> None:
    trainer = Trainer(fail=frozenset({"b"}))
    batcher = batcher_for(trainer)
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
