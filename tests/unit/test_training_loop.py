"""The optimizer-step loop and chunked logprobs on a tiny random Llama (built in memory, no files)."""

from __future__ import annotations

import math
from contextlib import nullcontext

import pytest
import torch
from artlike_server.torch_worker.logprobs import SelectedLogprobs, token_logprobs
from artlike_server.torch_worker.loop import BatchError, collate, run_optimizer_steps, validate_batch
from artlike_server.torch_worker.precision import MasterWeights
from artlike_server.trainer_ipc.sequences import TrainSequence
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from artlike.types import GRPOConfig, StepEvent

VOCAB = 97


def tiny_peft_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True,
    )  # fmt: skip
    base = LlamaForCausalLM(config)
    model = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    )
    # lora_B starts at 0; make it non-zero so gradients reach lora_A too and outputs differ from the base.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return model


def batch(seed: int = 1) -> list[TrainSequence]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for index, length in enumerate([48, 28, 80, 36, 60]):
        ids = torch.randint(3, VOCAB, (length,), generator=g).tolist()
        trainable = [i >= length // 2 for i in range(length)]
        logprobs = [-4.0 - 0.1 * i if t else 0.0 for i, t in enumerate(trainable)]
        out.append(TrainSequence(ids, trainable, logprobs, advantage=(-1.0) ** index * (1 + index / 10)))
    return out


def reference_logprobs(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=input_ids).logits.float()  # [B, T, V]
    return logits[:, :-1].log_softmax(-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)


@pytest.mark.parametrize("chunk_tokens", [1, 7, 4096])
def test_chunked_logprobs_equal_the_full_log_softmax(chunk_tokens: int) -> None:
    model = tiny_peft_model()
    ids = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(0))
    expected = reference_logprobs(model, ids)
    got, entropy = token_logprobs(model, ids, chunk_tokens=chunk_tokens)
    assert got.shape == entropy.shape == (3, 10)
    assert torch.allclose(got, expected, atol=1e-5)
    assert bool((entropy >= 0).all()) and bool((entropy <= math.log(VOCAB) + 1e-4).all())

    grads = []
    for fn in (
        lambda: reference_logprobs(model, ids),
        lambda: token_logprobs(model, ids, chunk_tokens=chunk_tokens)[0],
    ):
        model.zero_grad()
        fn()[:, 3:].sum().backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.requires_grad])
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(*grads, strict=True))


def test_selected_logprobs_match_log_softmax_in_value_entropy_and_gradient() -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 5, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(11, 5, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(11, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.tensor([0, 3, 10, 3, 7, 1])
    chosen, entropy = SelectedLogprobs.apply(hidden, weight, bias, targets)
    log_probs = torch.nn.functional.linear(hidden, weight, bias).log_softmax(-1)
    expected = log_probs.gather(-1, targets[:, None]).squeeze(-1)
    torch.testing.assert_close(chosen, expected)
    torch.testing.assert_close(entropy, -(log_probs.exp() * log_probs).sum(-1))
    assert not entropy.requires_grad  # reported, never trained on
    upstream = torch.randn(6, dtype=torch.float64, generator=g)
    ours = torch.autograd.grad(chosen, (hidden, weight, bias), upstream)
    theirs = torch.autograd.grad(expected, (hidden, weight, bias), upstream)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b)
    assert torch.autograd.gradcheck(lambda h, w, b: SelectedLogprobs.apply(h, w, b, targets)[0], (hidden, weight, bias))


@pytest.mark.parametrize("entropy_gradient", [False, True])
def test_a_bf16_head_keeps_its_log_probabilities_and_its_gradient_stays_within_bf16_rounding(
    entropy_gradient: bool,
) -> None:
    """A 16-bit model keeps log p in its dtype for the backward instead of recomputing the logits: the
    gradient matches float64 autograd to bf16's rounding (2⁻⁸ relative), also for confident targets (p ≈ 1,
    where a kept p would lose 1 − p)."""
    g = torch.Generator().manual_seed(3)
    hidden64 = torch.randn(16, 32, dtype=torch.float64, generator=g)
    weight64 = torch.randn(50, 32, dtype=torch.float64, generator=g) * 0.5
    targets = torch.randint(0, 50, (16,), generator=g)
    hidden64[:4] = 3 * weight64[targets[:4]]  # four near-certain targets
    hidden = hidden64.to(torch.bfloat16).requires_grad_()
    weight = weight64.to(torch.bfloat16)
    chosen, entropy = SelectedLogprobs.apply(hidden, weight, None, targets, entropy_gradient)
    upstream = torch.linspace(-1, 1, 16, dtype=torch.float32)
    ((chosen * upstream).sum() + (entropy.sum() if entropy_gradient else 0)).backward()
    # The reference: float64 from the same bf16 logits (the matmul's own rounding is not what is tested).
    logits = torch.nn.functional.linear(hidden.detach(), weight).double().requires_grad_()
    log_probs = logits.log_softmax(-1)
    expected = log_probs.gather(-1, targets[:, None]).squeeze(-1)
    assert float(expected[:4].detach().exp().min()) > 0.99
    reference_entropy = -(log_probs.exp() * log_probs).sum(-1)
    ((expected * upstream.double()).sum() + (reference_entropy.sum() if entropy_gradient else 0)).backward()
    assert hidden.grad is not None and logits.grad is not None
    reference = logits.grad @ weight.double()  # [16, 32]
    torch.testing.assert_close(chosen.double(), expected.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(hidden.grad.double(), reference, rtol=2**-7, atol=2**-7 * float(reference.abs().max()))
    confident = float(reference[:4].abs().max())
    torch.testing.assert_close(hidden.grad[:4].double(), reference[:4], rtol=2**-6, atol=2**-7 * confident)


def test_selected_logprobs_leave_a_frozen_head_without_gradient() -> None:
    hidden = torch.randn(4, 5, requires_grad=True)
    weight = torch.randn(9, 5)  # the LM head is frozen in LoRA training
    chosen, _ = SelectedLogprobs.apply(hidden, weight, None, torch.tensor([1, 2, 3, 4]))
    chosen.sum().backward()
    assert hidden.grad is not None and weight.grad is None


def test_logprobs_of_selected_positions_only() -> None:
    model = tiny_peft_model()
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.zeros((2, 8), dtype=torch.bool)
    mask[0, 5:] = True
    mask[1, 2:4] = True
    full, full_entropy = token_logprobs(model, ids)
    got, entropy = token_logprobs(model, ids, mask=mask, chunk_tokens=2)
    assert torch.allclose(got[mask], full[mask], atol=1e-6)
    assert torch.allclose(entropy[mask], full_entropy[mask], atol=1e-6)
    assert bool((got[~mask] == 0).all()) and bool((entropy[~mask] == 0).all())


def test_collate_right_pads_and_shifts_to_next_token_targets() -> None:
    seqs = [
        TrainSequence([1, 5, 6], [False, True, True], [0.0, -0.5, -0.6], 2.0),
        TrainSequence([1, 7], [False, True], [0.0, -0.7], -1.0),
    ]
    mb = collate(seqs, pad_token_id=0)
    assert mb.input_ids.tolist() == [[1, 5, 6], [1, 7, 0]]
    assert mb.mask.tolist() == [[True, True], [True, False]]
    assert torch.allclose(mb.behaviour_logprobs, torch.tensor([[-0.5, -0.6], [-0.7, 0.0]]))
    assert mb.advantages.tolist() == [2.0, -1.0]


def test_bad_batches_are_refused_before_training() -> None:
    with pytest.raises(BatchError):
        validate_batch([], VOCAB)
    with pytest.raises(BatchError):
        validate_batch([TrainSequence([1, VOCAB], [False, True], [0.0, -1.0], 1.0)], VOCAB)
    with pytest.raises(BatchError):
        validate_batch([TrainSequence([1, 2], [False, False], [0.0, 0.0], 1.0)], VOCAB)


def train(
    micro_batch_tokens: int, aggregation: str = "token", steps: int = 1
) -> tuple[list[StepEvent], list[torch.Tensor]]:
    model = tiny_peft_model()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.1)  # SGD: the update is the gradient, easy to compare
    config = GRPOConfig(
        learning_rate=0.1, micro_batch_tokens=micro_batch_tokens, loss_aggregation=aggregation,  # type: ignore[arg-type]
        gradient_steps_per_epoch=steps, max_grad_norm=None,
    )  # fmt: skip
    events: list[StepEvent] = []
    run_optimizer_steps(model, optimizer, batch(), config, pad_token_id=0, on_step=events.append)
    return events, [p.detach().clone() for p in params]


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_gradient_accumulation_over_micro_batches_equals_one_big_batch(aggregation: str) -> None:
    whole_events, whole_params = train(micro_batch_tokens=4096, aggregation=aggregation)
    split_events, split_params = train(micro_batch_tokens=64, aggregation=aggregation)  # 1-2 sequences each
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(whole_params, split_params, strict=True))
    assert split_events[0].loss == pytest.approx(whole_events[0].loss, abs=1e-6)
    assert split_events[0].grad_norm == pytest.approx(whole_events[0].grad_norm, rel=1e-5)
    assert split_events[0].entropy == pytest.approx(whole_events[0].entropy, rel=1e-5)


def test_one_event_per_optimizer_step_with_consistent_statistics() -> None:
    events, _ = train(micro_batch_tokens=100, steps=2)
    assert [e.gradient_step for e in events] == [1, 2]
    assert all(e.num_gradient_steps == 2 for e in events)
    trainable = sum(s.num_trainable_tokens for s in batch())
    assert sum(e.tokens for e in events) == trainable
    for e in events:
        assert math.isfinite(e.loss) and e.grad_norm > 0 and 0 <= e.clip_fraction <= 1
        assert e.logprob_mismatch > 0  # behaviour logprobs were made up: the metric sees it


def test_a_bf16_adapter_trains_through_fp32_masters_like_an_fp32_adapter() -> None:
    """The same step on a bf16 copy of the model (bf16 LoRA weights + fp32 masters) moves the adapter as the
    fp32 model does, up to bf16 rounding, and the model's bf16 weights are the rounded masters."""
    config = GRPOConfig(learning_rate=0.05, micro_batch_tokens=64, max_grad_norm=None)
    reference = tiny_peft_model()
    ref_params = [p for p in reference.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in ref_params]
    run_optimizer_steps(reference, torch.optim.SGD(ref_params, lr=0.05), batch(), config,
                        pad_token_id=0, on_step=lambda e: None)  # fmt: skip

    model = tiny_peft_model().to(torch.bfloat16)
    params = [p for p in model.parameters() if p.requires_grad]
    master = MasterWeights(params)
    master_before = [p.detach().clone() for p in master.parameters]
    events: list[StepEvent] = []
    run_optimizer_steps(model, torch.optim.SGD(master.parameters, lr=0.05), batch(), config,
                        pad_token_id=0, on_step=events.append, master=master)  # fmt: skip
    assert math.isfinite(events[0].loss) and events[0].grad_norm > 0
    assert all(p.grad is None for p in params)  # gradients went to the masters
    pairs = zip(before, ref_params, master_before, master.parameters, params, strict=True)
    for start, fp32_after, master_start, fp32_master, bf16_after in pairs:
        assert torch.equal(bf16_after, fp32_master.to(torch.bfloat16))
        fp32_update, master_update = fp32_after.detach() - start, fp32_master.detach() - master_start
        # the update, not the weights: bf16 forward/backward changes it by a few %, never its direction
        cosine = torch.nn.functional.cosine_similarity(fp32_update.flatten(), master_update.flatten(), dim=0)
        assert cosine > 0.95


def test_gradients_left_by_a_failed_job_do_not_leak_into_the_next_step() -> None:
    config = GRPOConfig(learning_rate=0.05, micro_batch_tokens=64, max_grad_norm=None)
    results = []
    for stale in (False, True):
        model = tiny_peft_model().to(torch.bfloat16)
        params = [p for p in model.parameters() if p.requires_grad]
        if stale:  # what an exception between backward and the optimizer step leaves behind
            for p in params:
                p.grad = torch.full_like(p, 100.0)
        master = MasterWeights(params)
        run_optimizer_steps(model, torch.optim.SGD(master.parameters, lr=0.05), batch(), config,
                            pad_token_id=0, on_step=lambda e: None, master=master)  # fmt: skip
        results.append([p.detach().clone() for p in master.parameters])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_kl_to_base_is_the_k3_estimate_against_the_model_with_its_adapter_disabled() -> None:
    model = tiny_peft_model()  # lora_B non-zero: the policy differs from the base
    sequences = batch()
    with torch.no_grad():
        model.eval()
        rows = []
        for context in (nullcontext, model.disable_adapter):  # the policy, then the base
            with context():
                rows.append([reference_logprobs(model, torch.tensor([s.token_ids]))[0] for s in sequences])
        model.train()
    trained = [torch.tensor(s.trainable[1:]) for s in sequences]
    diffs = torch.cat([(base - policy)[mask] for policy, base, mask in zip(*rows, trained, strict=True)])
    expected = float((diffs.exp() - diffs - 1).mean())

    events: list[StepEvent] = []
    params = [p for p in model.parameters() if p.requires_grad]
    config = GRPOConfig(learning_rate=0.05, micro_batch_tokens=64, measure_kl_to_base=True)
    run_optimizer_steps(model, torch.optim.SGD(params, lr=0.05), sequences, config, pad_token_id=0,
                        reference=model.disable_adapter, on_step=events.append)  # fmt: skip
    assert expected > 1e-4 and events[0].kl_to_base == pytest.approx(expected, rel=1e-4)

    unmeasured: list[StepEvent] = []
    run_optimizer_steps(model, torch.optim.SGD(params, lr=0.05), sequences, GRPOConfig(micro_batch_tokens=64),
                        pad_token_id=0, reference=model.disable_adapter, on_step=unmeasured.append)  # fmt: skip
    assert unmeasured[0].kl_to_base is None
