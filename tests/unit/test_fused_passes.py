"""Several sessions' passes as one (`torch_worker/fused_passes.py`, `Sessions.run_passes`) on a tiny random
Llama: each session gets the loss, logprobs and gradients its own pass gives, an adapter outside the pass
is untouched, a bad batch fails alone, and passes that cannot share micro-batches run on their own."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from artlike_server.torch_worker.adapters import AdapterSlots, peft_lora_config
from artlike_server.torch_worker.fused_passes import _spans, row_adapters
from artlike_server.torch_worker.training_sessions import Sessions
from artlike_server.trainer_ipc import protocol
from artlike_server.trainer_ipc.batch_file import write_batch
from artlike_server.trainer_ipc.sequences import TrainSequence
from artlike_server.trainer_ipc.tinker_loss import TinkerLossConfig

from artlike.session_types import AdamParams
from artlike.types import DPOConfig, LoraConfig, SFTConfig

from .test_training_loop import VOCAB
from .test_training_session_worker import sessions_on, tiny_base

MODELS = ("a", "b", "c")
RTOL, ATOL = 1e-4, 1e-6  # float32 sums over differently shaped batches


def trained_adapters(tmp_path: Path) -> tuple[AdapterSlots, Sessions]:
    """Three sessions whose adapters differ (lora_B drawn, not zero) on one base, plus an idle adapter."""
    adapters = AdapterSlots(tiny_base(), "tiny")
    sessions = sessions_on(adapters)
    for index, name in enumerate((*MODELS, "idle")):
        adapters.create(name, peft_lora_config(LoraConfig(rank=4, target_modules=["q_proj", "v_proj", "down_proj"]),
                                               "tiny"), seed=index)  # fmt: skip
        with torch.no_grad():
            for parameter in adapters.parameters(name):
                parameter.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(10 + index))
        directory = adapters.save(name, tmp_path / f"{name}-step0")
        sessions.open(protocol.SessionOpen(model_name=name, adapter_dir=str(directory),
                                           optimizer=AdamParams(learning_rate=1e-2)))
    return adapters, sessions


def batch(tmp_path: Path, name: str, seed: int, *, coefficients: bool) -> str:
    g = torch.Generator().manual_seed(seed)
    sequences = []
    for length in (7, 12, 9):
        ids = torch.randint(3, VOCAB, (length,), generator=g).tolist()
        trainable = [i >= 3 for i in range(length)]
        behaviour = [float(-torch.rand(1, generator=g)) if t else 0.0 for t in trainable]
        weights = [0.0] + [float(torch.randn(1, generator=g)) for _ in range(length - 1)] if coefficients else None
        sequences.append(TrainSequence(ids, trainable, behaviour, 0.5, token_advantages=weights))
    path = tmp_path / f"{name}-{seed}.batch"
    write_batch(path, sequences)
    return str(path)


def passes(tmp_path: Path) -> list[protocol.Pass]:
    """A Tinker cross-entropy pass, a Tinker PPO pass and an SFT pass: one per model, different objectives."""
    return [
        protocol.Pass(id=11, model_name="a", batch_path=batch(tmp_path, "a", 1, coefficients=True),
                      config=TinkerLossConfig(loss_fn="cross_entropy")),
        protocol.Pass(id=12, model_name="b", batch_path=batch(tmp_path, "b", 2, coefficients=True),
                      config=TinkerLossConfig(loss_fn="ppo")),
        protocol.Pass(id=13, model_name="c", batch_path=batch(tmp_path, "c", 3, coefficients=False),
                      config=SFTConfig()),
    ]


def gradients(adapters: AdapterSlots, name: str) -> list[torch.Tensor]:
    return [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in adapters.parameters(name)]


def test_a_fused_pass_gives_each_session_its_own_pass(tmp_path: Path) -> None:
    alone_adapters, alone = trained_adapters(tmp_path / "alone")
    fused_adapters, fused = trained_adapters(tmp_path / "fused")
    commands = passes(tmp_path)
    expected = [alone.run_pass(command) for command in commands]
    done = fused.run_passes(protocol.Passes(id=10, passes=commands))

    assert done.id == 10 and [r.id for r in done.results] == [11, 12, 13]
    for want, got in zip(expected, done.results, strict=True):
        assert isinstance(got, protocol.PassDone)
        assert got.fused == 3 and want.fused == 1 and got.objective == want.objective
        assert got.loss == pytest.approx(want.loss, rel=RTOL) and got.tokens == want.tokens
        for want_row, got_row in zip(want.logprobs, got.logprobs, strict=True):
            assert [v is None for v in got_row] == [v is None for v in want_row]
            assert [v for v in got_row if v is not None] == pytest.approx([v for v in want_row if v is not None],
                                                                          rel=RTOL, abs=ATOL)  # fmt: skip
    for name in MODELS:
        for want_grad, got_grad in zip(gradients(alone_adapters, name), gradients(fused_adapters, name), strict=True):
            assert float(want_grad.abs().max()) > 0  # every adapter learns something here
            torch.testing.assert_close(got_grad, want_grad, rtol=RTOL, atol=ATOL)
    # The sessions' gradients differ (each adapter saw only its own rows) and the idle adapter got none.
    assert not torch.allclose(gradients(fused_adapters, "a")[0], gradients(fused_adapters, "b")[0])
    assert all(p.grad is None for p in fused_adapters.parameters("idle"))
    # Afterwards exactly one adapter's parameters require gradients, as after any command.
    requiring = [name for name in (*MODELS, "idle") if any(p.requires_grad for p in fused_adapters.parameters(name))]
    assert len(requiring) == 1

    # The optimizer steps that follow are each session's own: the same weights as after separate passes.
    for name in MODELS:
        step = protocol.OptimStep(model_name=name, optimizer=AdamParams(learning_rate=1e-2))
        assert fused.optim_step(step).grad_norm == pytest.approx(alone.optim_step(step).grad_norm, rel=RTOL)
        for want_weight, got_weight in zip(alone_adapters.parameters(name), fused_adapters.parameters(name),
                                           strict=True):  # fmt: skip
            torch.testing.assert_close(got_weight, want_weight, rtol=RTOL, atol=ATOL)


def test_forward_only_passes_fuse_without_gradients(tmp_path: Path) -> None:
    adapters, sessions = trained_adapters(tmp_path)
    commands = [c.model_copy(update={"backward": False}) for c in passes(tmp_path)]
    done = sessions.run_passes(protocol.Passes(passes=commands))
    assert all(isinstance(r, protocol.PassDone) and r.fused == 3 for r in done.results)
    assert all(p.grad is None for name in MODELS for p in adapters.parameters(name))


def test_a_bad_batch_fails_alone_and_an_unfusable_pass_runs_on_its_own(tmp_path: Path) -> None:
    adapters, sessions = trained_adapters(tmp_path)
    good, bad, _ = passes(tmp_path)
    outside = tmp_path / "outside.batch"
    write_batch(outside, [TrainSequence([1, VOCAB + 5, 2], [False, True, True], [0.0, math.nan, math.nan], 1.0,
                                        token_advantages=[0.0, 1.0, 1.0])])  # fmt: skip
    bad = bad.model_copy(update={"batch_path": str(outside)})
    pair = tmp_path / "pair.batch"
    write_batch(pair, [TrainSequence([1, 5, 6, 7], [False, False, True, True], [0.0, 0.0, -1.0, -1.0], 0.0,
                                     group_index=0, preference=side) for side in (1, -1)])  # fmt: skip
    dpo = protocol.Pass(id=14, model_name="c", batch_path=str(pair), config=DPOConfig())
    done = sessions.run_passes(protocol.Passes(passes=[good, bad, dpo]))
    first, second, third = done.results
    assert isinstance(first, protocol.PassDone) and first.fused == 1  # its partner failed: nothing to fuse with
    assert isinstance(second, protocol.Failed) and second.kind == "BatchError" and second.id == bad.id
    assert isinstance(third, protocol.PassDone) and third.fused == 1 and third.objective == "dpo"
    assert all(p.grad is None for p in adapters.parameters("b"))


def test_a_pass_whose_sequences_share_a_prompt_keeps_its_prefix_sharing(tmp_path: Path) -> None:
    _, sessions = trained_adapters(tmp_path)
    good = passes(tmp_path)[0]
    prompt = list(range(3, 3 + 80))  # longer than a call's overhead: worth running once for the group
    group = tmp_path / "group.batch"
    write_batch(group, [TrainSequence([*prompt, 5 + i, 6 + i], [False] * 80 + [True, True], [0.0] * 80 + [-1.0, -1.0],
                                      1.0) for i in range(4)])  # fmt: skip
    shared = protocol.Pass(id=15, model_name="c", batch_path=str(group), config=SFTConfig())
    done = sessions.run_passes(protocol.Passes(passes=[good, shared]))
    assert [r.fused for r in done.results if isinstance(r, protocol.PassDone)] == [1, 1]
    unshared = shared.model_copy(update={"config": SFTConfig(share_prefixes=False)})
    done = sessions.run_passes(protocol.Passes(passes=[good, unshared]))
    assert [r.fused for r in done.results if isinstance(r, protocol.PassDone)] == [2, 2]


def test_passes_of_one_model_twice_are_refused() -> None:
    one = protocol.Pass(model_name="a", batch_path="x", config=SFTConfig())
    with pytest.raises(ValueError, match="one pass"):
        protocol.Passes(passes=[one, one])


def test_row_adapters_route_each_block_of_rows_through_its_adapter(tmp_path: Path) -> None:
    adapters, _ = trained_adapters(tmp_path)
    model = adapters.model
    model.eval()
    ids = torch.randint(3, VOCAB, (4, 6), generator=torch.Generator().manual_seed(0))
    single = {}
    for name in ("a", "b"):
        adapters.activate(name)
        with torch.no_grad():
            single[name] = model(input_ids=ids).logits
    blocks = [(adapters.slot("a").key, 0, 1), (adapters.slot("b").key, 1, 4)]
    with torch.no_grad(), row_adapters(model, blocks):
        mixed = model(input_ids=ids).logits
    torch.testing.assert_close(mixed[:1], single["a"][:1], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(mixed[1:], single["b"][1:], rtol=RTOL, atol=ATOL)
    assert not torch.allclose(single["a"][1:], single["b"][1:])

    # Adapters of different ranks (or with dropout) take the layer block by block: the same routing.
    adapters.create("wide", peft_lora_config(LoraConfig(rank=8, target_modules=["q_proj", "v_proj", "down_proj"]),
                                             "tiny"), seed=7)  # fmt: skip
    with torch.no_grad():
        for parameter in adapters.parameters("wide"):
            parameter.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(7))
        single["wide"] = model(input_ids=ids).logits  # create() made it the active adapter
        with row_adapters(model, [(adapters.slot("wide").key, 0, 2), (adapters.slot("a").key, 2, 4)]):
            mixed = model(input_ids=ids).logits
    torch.testing.assert_close(mixed[:2], single["wide"][:2], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(mixed[2:], single["a"][2:], rtol=RTOL, atol=ATOL)


def test_spans_group_equal_owners() -> None:
    assert _spans([1, 1, 1]) == [(1, 0, 3)]
    assert _spans([0, 2, 2, 3]) == [(0, 0, 1), (2, 1, 3), (3, 3, 4)]
