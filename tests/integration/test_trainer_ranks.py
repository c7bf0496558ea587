"""The trainer worker under torchrun with 2 CPU ranks (gloo) against the single-process worker.

The same commands on the same batch and initial adapter must give the same optimizer step: the 2-rank
worker splits each step's micro-batches between its ranks (unevenly here) and sums their gradients.
Float32 throughout; what differs is only the order of float additions, hence the tolerances below.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from artlike_server.default_model import ensure_default_model
from artlike_server.trainer_ipc import protocol
from artlike_server.trainer_ipc.batch_file import write_batch
from artlike_server.trainer_ipc.sequences import TrainSequence
from artlike_server.training.trainer_client import TrainerError, TrainerProcess
from safetensors.torch import load_file

from artlike.session_types import AdamParams
from artlike.types import GRPOConfig, LoraConfig

pytestmark = pytest.mark.integration

MODEL_NAME = "ranks-test.m"
LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])
TEXTS = [
    "Two plus three is five, and five plus five is ten; arithmetic is a matter of counting carefully.",
    "The capital of Italy is Rome, a city on the Tiber with almost three million people.",
    "Hello there! How are you today?",
    "Blue is the colour of the sky on a clear day, and of the sea when the sky above it is clear too, "
    "though at dusk both turn grey and then black.",
    "Paris is in France; Berlin is in Germany; Madrid is in Spain; Lisbon is in Portugal.",
]
LEARNING_RATE = 1e-3
# Several micro-batches of different sizes per step, split unevenly between 2 ranks.
SPLIT = GRPOConfig(learning_rate=LEARNING_RATE, micro_batch_tokens=64, share_prefixes=False)
# One micro-batch: rank 1 has nothing to do (its gradients count as zeros).
WHOLE = GRPOConfig(learning_rate=LEARNING_RATE, micro_batch_tokens=4096)
WEIGHT_ATOL = 1e-6  # |Δw| after one AdamW step of lr 1e-3 (updates are ~1e-3)
# AdamW's first update is lr·g/(|g| + ε). Where |g| is below ε (1e-8) the update is under lr/2 and its size
# follows g's last bits, which the order of additions decides (seen: a thousandth of lr).
NEAR_EPSILON_ATOL = LEARNING_RATE * 1e-2
RTOL = 1e-4  # loss, grad norm, logprobs: sums of a few hundred float32 terms in another order


@dataclass
class Run:
    """What one trainer (1 or 2 ranks) answered to the same commands."""

    ready: protocol.Ready | None = None
    steps: dict[str, protocol.Step] = field(default_factory=dict)
    passed: protocol.PassDone | None = None
    optimized: protocol.Optimized | None = None
    bad_batch: str = ""


def sequences(tokenizer: Any) -> list[TrainSequence]:
    out = []
    for index, text in enumerate(TEXTS):
        ids = [tokenizer.bos_token_id or 0, *tokenizer.encode(text, add_special_tokens=False)]
        behaviour = [-1.0 if index % 2 else math.nan] * (len(ids) - 3)
        out.append(TrainSequence(
            token_ids=ids,
            trainable=[False] * 3 + [True] * (len(ids) - 3),
            behaviour_logprobs=[0.0] * 3 + behaviour,
            advantage=(1.0, -0.5, 0.25, -1.0, 0.75)[index],
            trajectory_id=f"t{index}",
        ))  # fmt: skip
    return out


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ranks")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ensure_default_model())
    batch = sequences(tokenizer)
    assert len({s.num_tokens for s in batch}) == len(batch)
    write_batch(path / "batch.safetensors", batch)
    bad = [*batch[:1], TrainSequence(token_ids=[0, 10**7], trainable=[False, True], behaviour_logprobs=[0.0, 0.0],
                                     advantage=1.0)]
    write_batch(path / "bad.safetensors", bad)
    return path


async def drive(trainer: TrainerProcess, workdir: Path, name: str) -> Run:
    """The commands both trainers get, writing under workdir/name."""
    run = Run(ready=await trainer.start())
    out = workdir / name
    await trainer.init_adapter(MODEL_NAME, LORA, out / "init", seed=1)
    start = workdir / "one" / "init"  # both train from the single-process trainer's adapter
    batch = workdir / "batch.safetensors"
    for label, config in (("split", SPLIT), ("whole", WHOLE)):
        events = [e async for e in trainer.train(MODEL_NAME, start, out / label, batch, config)]
        run.steps[label] = next(e for e in events if isinstance(e, protocol.Step))
        assert isinstance(events[-1], protocol.Saved)
    try:
        _ = [e async for e in trainer.train(MODEL_NAME, start, out / "bad", workdir / "bad.safetensors", SPLIT)]
    except TrainerError as error:
        run.bad_batch = error.kind
    await trainer.ping()  # a command that failed on every rank leaves the worker up
    adam = AdamParams(learning_rate=LEARNING_RATE)
    opened = await trainer.session_command(protocol.SessionOpen(model_name=MODEL_NAME, adapter_dir=str(start),
                                                                optimizer=adam))  # fmt: skip
    assert isinstance(opened, protocol.SessionReady)
    passed = await trainer.session_command(protocol.Pass(model_name=MODEL_NAME, batch_path=str(batch), config=SPLIT))
    optimized = await trainer.session_command(protocol.OptimStep(model_name=MODEL_NAME, optimizer=adam))
    saved = await trainer.session_command(protocol.SaveState(model_name=MODEL_NAME, out_dir=str(out / "session")))
    assert isinstance(passed, protocol.PassDone) and isinstance(optimized, protocol.Optimized)
    assert isinstance(saved, protocol.Saved)
    run.passed, run.optimized = passed, optimized
    return run


@pytest.fixture(scope="module")
async def runs(workdir: Path) -> dict[str, Run]:
    results: dict[str, Run] = {}
    # One after the other, one thread per process either way: 2 ranks get a core each, and a kernel's
    # rounding may depend on its thread count (small attention's batched matmuls do), which AdamW's first
    # update (lr·g/(|g| + ε)) amplifies where a gradient is near ε.
    for name, ranks in (("one", 1), ("two", 2)):
        trainer = TrainerProcess(ensure_default_model(), dtype="float32", device="cpu", ranks=ranks, threads=1,
                                 log_path=workdir / f"{name}.log")  # fmt: skip
        try:
            results[name] = await drive(trainer, workdir, name)
        finally:
            await trainer.stop()
    return results


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "adapter_model.safetensors"))


def assert_same_weights(one: Path, two: Path, start: Path) -> None:
    first, second, initial = weights(one), weights(two), weights(start)
    assert first.keys() == second.keys()
    moved = max(float((first[k] - initial[k]).abs().max()) for k in first)
    assert moved > 1e-4, "the step changed nothing: the comparison would prove nothing"
    for key in first:
        near_epsilon = (first[key] - initial[key]).abs() < LEARNING_RATE / 2
        allowed = torch.where(near_epsilon, NEAR_EPSILON_ATOL, WEIGHT_ATOL)
        difference = (second[key] - first[key]).abs()
        worst = int((difference - allowed).argmax())
        assert bool((difference <= allowed).all()), (
            f"{key}: {int((difference > allowed).sum())} of {difference.numel()} differ; at flat index {worst} by "
            f"{float(difference.flatten()[worst]):.3g} (allowed {float(allowed.flatten()[worst]):.3g})")


def assert_same_step(one: protocol.Step, two: protocol.Step) -> None:
    assert (two.tokens, two.decoder_positions) == (one.tokens, one.decoder_positions)
    for name in ("loss", "policy_loss", "grad_norm", "entropy", "logprob_mismatch"):
        assert getattr(two, name) == pytest.approx(getattr(one, name), rel=RTOL, abs=1e-7), name


def test_the_worker_runs_as_two_ranks(runs: dict[str, Run]) -> None:
    assert runs["one"].ready is not None and runs["one"].ready.ranks == 1
    assert runs["two"].ready is not None and runs["two"].ready.ranks == 2


def test_a_fresh_adapter_is_the_same_on_two_ranks(runs: dict[str, Run], workdir: Path) -> None:
    first, second = weights(workdir / "one" / "init"), weights(workdir / "two" / "init")
    assert all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.parametrize("label", ["split", "whole"])
def test_one_optimizer_step_on_two_ranks_equals_the_one_rank_step(
    runs: dict[str, Run], workdir: Path, label: str
) -> None:
    assert_same_step(runs["one"].steps[label], runs["two"].steps[label])
    assert_same_weights(workdir / "one" / label, workdir / "two" / label, workdir / "one" / "init")


def test_a_session_pass_and_step_on_two_ranks_equal_the_one_rank_ones(runs: dict[str, Run], workdir: Path) -> None:
    one, two = runs["one"], runs["two"]
    assert one.passed is not None and two.passed is not None
    assert two.passed.tokens == one.passed.tokens
    assert two.passed.loss == pytest.approx(one.passed.loss, rel=RTOL, abs=1e-7)
    for first, second in zip(one.passed.logprobs, two.passed.logprobs, strict=True):  # gathered from both ranks
        assert [v is None for v in second] == [v is None for v in first]
        assert [v for v in second if v is not None] == pytest.approx([v for v in first if v is not None], rel=RTOL)
    assert one.optimized is not None and two.optimized is not None
    assert two.optimized.grad_norm == pytest.approx(one.optimized.grad_norm, rel=RTOL)
    assert_same_weights(workdir / "one" / "session", workdir / "two" / "session", workdir / "one" / "init")


def test_a_bad_batch_fails_on_every_rank_and_the_worker_carries_on(runs: dict[str, Run]) -> None:
    assert runs["one"].bad_batch == runs["two"].bad_batch == "BatchError"
