"""The worker side of training sessions (`torch_worker/training_sessions.py`) on a tiny random Llama: passes accumulate
gradients until optim_step, forward leaves none, save_state writes the optimizer state that a new session
(even in a new worker) reads back, and a closed session refuses commands. Plus the wire types' checks and
the importance-sampling loss the `importance_sampling` primitive uses."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from artlike_server.torch_worker.adapters import OPTIMIZER_FILE, AdapterSlots, peft_lora_config
from artlike_server.torch_worker.objectives.grpo import policy_loss
from artlike_server.torch_worker.objectives.importance_sampling import importance_sampling_loss
from artlike_server.torch_worker.training_sessions import SessionError, Sessions
from artlike_server.trainer_ipc import protocol
from artlike_server.trainer_ipc.batch_file import write_batch
from artlike_server.trainer_ipc.sequences import TrainSequence
from pydantic import ValidationError
from transformers import LlamaConfig, LlamaForCausalLM

from artlike.session_types import AdamParams, ForwardRequest, SessionSequence
from artlike.types import LoraConfig, SFTConfig

from .test_training_loop import VOCAB


def tiny_base() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def sessions_on(adapters: AdapterSlots) -> Sessions:
    return Sessions(adapters, pad_token_id=0, vocab_size=VOCAB, device=torch.device("cpu"))


def batch_file(tmp_path: Path, name: str, seed: int) -> str:
    g = torch.Generator().manual_seed(seed)
    sequences = []
    for length in (9, 14):
        ids = torch.randint(3, VOCAB, (length,), generator=g).tolist()
        trainable = [i >= 4 for i in range(length)]
        sequences.append(TrainSequence(ids, trainable, [math.nan if t else 0.0 for t in trainable], 0.0))
    path = tmp_path / f"{name}.batch"
    write_batch(path, sequences)
    return str(path)


@pytest.fixture
def step0(tmp_path: Path) -> tuple[AdapterSlots, Path]:
    adapters = AdapterSlots(tiny_base(), "tiny")
    adapters.create("m", peft_lora_config(LoraConfig(rank=4, target_modules=["q_proj", "v_proj"]), "tiny"), seed=0)
    return adapters, adapters.save("m", tmp_path / "step0")


def test_passes_accumulate_until_the_optimizer_step(tmp_path: Path, step0: tuple[AdapterSlots, Path]) -> None:
    adapters, directory = step0
    sessions = sessions_on(adapters)
    ready = sessions.open(protocol.SessionOpen(model_name="m", adapter_dir=str(directory),
                                               optimizer=AdamParams(learning_rate=1e-2)))
    assert ready.optimizer_state == "fresh"
    params = adapters.parameters("m")
    scored = protocol.Pass(model_name="m", batch_path=batch_file(tmp_path, "a", 1), config=SFTConfig(),
                           backward=False)
    forward = sessions.run_pass(scored)
    assert all(p.grad is None for p in params)  # forward: no gradient
    assert [len(row) for row in forward.logprobs] == [9, 14]
    assert forward.logprobs[0][:4] == [None] * 4 and all(v is not None and v < 0 for v in forward.logprobs[0][4:])

    first = sessions.run_pass(scored.model_copy(update={"backward": True}))
    assert first.loss == pytest.approx(forward.loss) and first.objective == "sft"
    grads = [p.grad.clone() for p in params if p.grad is not None]
    sessions.run_pass(protocol.Pass(model_name="m", batch_path=batch_file(tmp_path, "b", 2), config=SFTConfig()))
    assert any(not torch.equal(a, p.grad) for a, p in zip(grads, (p for p in params if p.grad is not None),
                                                            strict=True))  # the second pass added to them
    before = [p.detach().clone() for p in params]
    done = sessions.optim_step(protocol.OptimStep(model_name="m", optimizer=AdamParams(learning_rate=1e-2)))
    assert done.grad_norm > 0 and all(p.grad is None for p in params)
    assert any(not torch.equal(a, p) for a, p in zip(before, params, strict=True))
    trained = sessions.run_pass(scored).loss
    assert trained < forward.loss  # the step lowered the loss it followed

    saved = sessions.save(protocol.SaveState(model_name="m", out_dir=str(tmp_path / "step1")))
    assert (Path(saved.path) / OPTIMIZER_FILE).is_file()
    sessions.close(protocol.SessionClose(model_name="m"))
    with pytest.raises(SessionError):
        sessions.run_pass(scored)

    # A new worker (fresh adapters) resumes the saved step with its Adam moments.
    resumed = AdapterSlots(tiny_base(), "tiny")
    again = sessions_on(resumed)
    assert again.open(protocol.SessionOpen(model_name="m", adapter_dir=saved.path,
                                           optimizer=AdamParams())).optimizer_state == "loaded"
    state = resumed.slot("m").optimizer.state_dict()["state"]  # type: ignore[union-attr]
    assert state and all(float(s["step"]) == 1.0 for s in state.values())
    assert again.run_pass(scored).loss == pytest.approx(trained, rel=1e-4)  # the same weights


def test_importance_sampling_is_the_unclipped_ratio_times_the_advantage() -> None:
    logprobs = torch.tensor([[-0.5, -1.0]], requires_grad=True)
    behaviour = torch.tensor([[-1.0, -1.0]])  # ratios e^0.5 and 1
    mask = torch.tensor([[True, True]])
    out = importance_sampling_loss(logprobs, behaviour, torch.tensor([1.0]), mask)
    assert float(out.loss.detach()) == pytest.approx(-(math.exp(0.5) + 1.0) / 2)
    clipped = policy_loss(logprobs, behaviour, torch.tensor([1.0]), mask, epsilon_low=0.2, epsilon_high=0.28)
    assert float(clipped.loss.detach()) == pytest.approx(-(1.28 + 1.0) / 2)  # GRPO clips the first token
    out.loss.backward()
    assert logprobs.grad is not None
    assert logprobs.grad.flatten().tolist() == pytest.approx([-math.exp(0.5) / 2, -0.5])


@pytest.mark.parametrize("body", [
    {"token_ids": [1, 2, 3], "trainable": [False, True]},  # misaligned
    {"token_ids": [1, 2, 3], "pair": 0},  # a pair needs its side
    {"token_ids": [1, 2], "trainable": [True, False]},  # nothing after the first token is scored
    {"token_ids": [1]},
])
def test_bad_sequences_are_refused_before_sending(body: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        SessionSequence.model_validate(body)


def test_a_loss_config_is_its_objectives_config() -> None:
    request = ForwardRequest(sequences=[SessionSequence(token_ids=[1, 2])], loss="ppo",
                             loss_config={"epsilon_high": 0.3})
    assert request.config().objective == "grpo" and request.config().epsilon_high == 0.3  # type: ignore[union-attr]
    with pytest.raises(ValidationError):
        ForwardRequest(sequences=[SessionSequence(token_ids=[1, 2])], loss="dpo",
                       loss_config={"bta": 0.1}).config()
    with pytest.raises(ValidationError):
        ForwardRequest()
