"""SFT: the cross-entropy objective, the learning-rate schedule, the request's data rules, last-turn-only
sequences, and the client's example building (`best_of_groups`, `train_sft` bodies)."""

from __future__ import annotations

import doctest
import itertools
import math

import pytest
import torch
from artlike_server.torch_worker import schedule
from artlike_server.torch_worker.loop import run_optimizer_steps
from artlike_server.torch_worker.objectives.sft import cross_entropy_loss
from artlike_server.torch_worker.schedule import learning_rate_at
from artlike_server.trainer_ipc.sequences import Turn, merge_turns
from pydantic import ValidationError

import artlike as art
from artlike import _sft
from artlike._sft import build_sft_request, to_example
from artlike.types import GRPOConfig, MessagesExample, RecordedExample, SFTConfig, StepEvent, TrainRequest

from .test_training_loop import batch, tiny_peft_model


def test_doctests() -> None:
    assert doctest.testmod(schedule, raise_on_error=True).attempted >= 2
    assert doctest.testmod(_sft, raise_on_error=True).attempted >= 2


def test_cross_entropy_is_the_mean_nll_of_the_trainable_tokens() -> None:
    logprobs = torch.tensor([[math.log(0.5), math.log(0.25), -7.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True, True, False]])
    out = cross_entropy_loss(logprobs, mask)
    assert float(out.loss.detach()) == pytest.approx((math.log(2) + math.log(4)) / 2)
    out.loss.backward()
    assert logprobs.grad is not None and logprobs.grad.flatten().tolist() == pytest.approx([-0.5, -0.5, 0.0])
    total, count = out.metrics["nll"]
    assert float(total / count) == pytest.approx(math.log(8) / 2)
    # The step's normaliser, not the micro-batch's: halves add up to the whole.
    assert float(cross_entropy_loss(logprobs, mask, normalizer=4).loss.detach()) == pytest.approx(math.log(8) / 4)


def test_cosine_schedule_with_warmup() -> None:
    rates = [learning_rate_at(s, 6, 1e-4, schedule="cosine", warmup_steps=2) for s in range(1, 7)]
    assert rates[:2] == pytest.approx([1e-4 / 3, 2e-4 / 3])
    assert rates[2] == pytest.approx(1e-4)  # the first step after warmup: the full rate
    assert rates[3:] == pytest.approx([1e-4 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in (1, 2, 3)])
    assert all(a > b for a, b in itertools.pairwise(rates[2:]))
    with pytest.raises(ValueError):
        learning_rate_at(7, 6, 1e-4, schedule="cosine")


def test_the_loop_reports_each_steps_scheduled_rate() -> None:
    model = tiny_peft_model()
    params = [p for p in model.parameters() if p.requires_grad]
    config = SFTConfig(learning_rate=0.1, gradient_steps_per_epoch=3, micro_batch_tokens=64, max_grad_norm=None)
    events: list[StepEvent] = []
    run_optimizer_steps(model, torch.optim.SGD(params, lr=1.0), batch(), config, pad_token_id=0,
                        on_step=events.append)
    assert [e.objective for e in events] == ["sft"] * 3
    assert [e.learning_rate for e in events] == pytest.approx([0.1 * 0.5 * (1 + math.cos(math.pi * k / 3))
                                                                for k in range(3)])
    assert all(set(e.metrics) == {"nll"} and e.metrics["nll"] > 0 for e in events)


def test_last_turn_only_keeps_earlier_turns_as_context() -> None:
    turns = [Turn([1, 2], [3, 4], [-1.0, -1.0]), Turn([1, 2, 3, 4, 5], [6, 7], [-1.0, -1.0])]
    [both] = merge_turns(turns, 1.0)
    assert both.trainable == [False, False, True, True, False, True, True]
    last = [Turn(t.prompt_ids, t.output_ids, t.output_logprobs, trainable=i == 1) for i, t in enumerate(turns)]
    [only_last] = merge_turns(last, 1.0)
    assert only_last.token_ids == both.token_ids
    assert only_last.trainable == [False, False, False, False, False, True, True]


@pytest.mark.parametrize(("body", "param"), [
    ({"config": {"objective": "sft"}}, "examples"),
    ({"config": {"objective": "sft"}, "examples": [{"trajectory_id": "t"}],
      "groups": [{"trajectories": [{"trajectory_id": "u", "reward": 1.0}]}]}, "groups"),
    ({"examples": [{"trajectory_id": "t"}], "groups": [{"trajectories": [{"trajectory_id": "u", "reward": 1.0}]}]},
     "examples"),
    ({"config": {"objective": "sft"}, "examples": [{"messages": [{"role": "user", "content": "hi"}]}]}, "examples"),
])
def test_the_data_must_fit_the_objective(body: dict[str, object], param: str) -> None:
    with pytest.raises(ValidationError) as bad:
        TrainRequest.model_validate({"model": "m", **body})
    assert bad.value.errors()[0]["loc"][0] == param


def test_examples_from_trajectories_and_messages() -> None:
    offline = art.Trajectory([{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}], reward=1.0)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert to_example(offline) == MessagesExample(messages=offline.messages())
    assert to_example(messages) == MessagesExample(messages=messages)
    assert to_example({"messages": messages, "tools": [{"type": "function"}]}).tools == [{"type": "function"}]
    request = build_sft_request("m", [offline, messages], SFTConfig())
    assert request.groups == [] and len(request.examples) == 2
    with pytest.raises(ValueError, match="SFT config"):
        build_sft_request("m", [messages], GRPOConfig())
    with pytest.raises(ValueError, match="no examples"):
        build_sft_request("m", [], SFTConfig())
    assert RecordedExample(trajectory_id="abc").trajectory_id == "abc"
