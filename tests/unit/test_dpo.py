"""DPO on the objective seam: each loss type on hand-computed pairs (dpo.py's docstring), gradients, the
pair-aware plan (a pair never straddles an optimizer step or a micro-batch), the loop, and bad requests."""

from __future__ import annotations

import copy
import doctest
import math
from collections import Counter

import orjson
import pytest
import torch
from artlike_server.errors import InvalidRequest
from artlike_server.torch_worker import packing
from artlike_server.torch_worker.loop import collate, plan_job, plan_step, run_optimizer_steps, validate_batch
from artlike_server.torch_worker.objectives import PolicyBatch, build_objective, dpo
from artlike_server.torch_worker.objectives.dpo import dpo_loss
from artlike_server.trainer_ipc import steps
from artlike_server.trainer_ipc.sequences import TrainSequence
from artlike_server.training.api_router import parse_train_request
from pydantic import ValidationError

from artlike.types import DPOConfig, StepEvent, TrainRequest, train_config

from .test_training_loop import VOCAB, tiny_peft_model

PAIRS = torch.tensor([[0, 1]])
MASK = torch.tensor([[True, True], [True, True]])


def policy() -> torch.Tensor:
    # chosen sums to -3 (mean -1.5), rejected to -4 (mean -2)
    return torch.tensor([[-1.0, -2.0], [-2.0, -2.0]], dtype=torch.float64, requires_grad=True)


REFERENCE = torch.tensor([[-1.5, -2.0], [-1.5, -2.0]], dtype=torch.float64)  # both sum to -3.5 (mean -1.75)


def test_doctests() -> None:
    for module in (dpo, packing, steps):
        assert doctest.testmod(module).failed == 0


@pytest.mark.parametrize(("loss_type", "smoothing", "beta", "expected"), [
    # h = (-3 + 3.5) - (-4 + 3.5) = 1: -log σ(0.5) = log(1 + e^-0.5)
    ("sigmoid", 0.0, 0.5, math.log1p(math.exp(-0.5))),
    # 0.9 · 0.474077 + 0.1 · 0.974077 (−log σ(−0.5) = log(1 + e^0.5))
    ("sigmoid", 0.1, 0.5, 0.9 * math.log1p(math.exp(-0.5)) + 0.1 * math.log1p(math.exp(0.5))),
    # (0.9 · 0.474077 − 0.1 · 0.974077) / 0.8
    ("robust", 0.1, 0.5, (0.9 * math.log1p(math.exp(-0.5)) - 0.1 * math.log1p(math.exp(0.5))) / 0.8),
    ("hinge", 0.0, 0.5, 1.0 - 0.5 * 1.0),
    # mean logprobs: h = (-1.5 + 1.75) - (-2 + 1.75) = 0.5; (0.5 - 1/(2·0.5))² = 0.25
    ("ipo", 0.0, 0.5, 0.25),
])
def test_each_loss_type_on_a_worked_pair(loss_type: str, smoothing: float, beta: float, expected: float) -> None:
    out = dpo_loss(policy(), MASK, PAIRS, ref_logprobs=REFERENCE, beta=beta, loss_type=loss_type,  # type: ignore[arg-type]
                   label_smoothing=smoothing)
    assert float(out.loss.detach()) == pytest.approx(expected, abs=1e-9)
    if loss_type != "ipo":
        metrics = {name: float(total / count) for name, (total, count) in out.metrics.items()}
        assert metrics == pytest.approx({"rewards_chosen": beta * 0.5, "rewards_rejected": -beta * 0.5,
                                         "reward_margin": beta, "reward_accuracy": 1.0,
                                         "logps_chosen": -3.0, "logps_rejected": -4.0})


def test_reference_free_scores_the_policy_alone_and_the_gradient_is_beta_sigma() -> None:
    logprobs = policy()
    out = dpo_loss(logprobs, MASK, PAIRS, ref_logprobs=None, beta=1.0)
    assert float(out.loss.detach()) == pytest.approx(math.log1p(math.exp(-1.0)))  # h = -3 - (-4) = 1
    out.loss.backward()
    weight = 1.0 / (1.0 + math.exp(1.0))  # σ(−βh): how wrong the pair still is
    assert logprobs.grad is not None
    assert logprobs.grad.flatten().tolist() == pytest.approx([-weight, -weight, weight, weight])


def test_the_step_normaliser_is_the_number_of_pairs() -> None:
    objective = build_objective(DPOConfig())
    sides = [TrainSequence([0] * (n + 1), [False] + [True] * n, [0.0] * (n + 1), 0.0) for n in (3, 5, 2, 2)]
    assert objective.normalizer(sides) == 2
    logprobs = policy()
    half = objective.loss(PolicyBatch(logprobs, MASK, torch.full((2, 2), math.nan), torch.zeros(2), REFERENCE,
                                      PAIRS), normalizer=2.0)
    whole = dpo_loss(policy(), MASK, PAIRS, ref_logprobs=REFERENCE, beta=0.1)
    assert float(half.loss) == pytest.approx(float(whole.loss) / 2)


@pytest.mark.parametrize("loss_type", ["sigmoid", "robust", "hinge", "ipo"])
def test_analytic_gradients_match_finite_differences(loss_type: str) -> None:
    g = torch.Generator().manual_seed(0)
    start = -torch.rand(4, 3, generator=g, dtype=torch.float64) - 0.5
    reference = start.detach() - 0.3 * torch.rand(4, 3, generator=g, dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, True, True], [True, False, False], [True, True, True]])
    pairs = torch.tensor([[1, 0], [2, 3]])
    smoothing = 0.2 if loss_type in ("sigmoid", "robust") else 0.0

    def loss(logprobs: torch.Tensor) -> torch.Tensor:
        return dpo_loss(logprobs, mask, pairs, ref_logprobs=reference, beta=0.7, loss_type=loss_type,  # type: ignore[arg-type]
                        label_smoothing=smoothing).loss

    assert torch.autograd.gradcheck(loss, (start.clone().requires_grad_(True),))


# ------------------------------------------------------------------------------------------ the plan


def pairs_batch(prompt: int = 8, seed: int = 3) -> list[TrainSequence]:
    """Four pairs: each pair's answers share a `prompt`-token prompt, answers of different lengths."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for pair in range(4):
        shared = torch.randint(3, VOCAB, (prompt,), generator=g).tolist()
        for preference, answer in ((1, 6 + pair), (-1, 9 - pair)):
            ids = shared + torch.randint(3, VOCAB, (answer,), generator=g).tolist()
            trainable = [i >= prompt for i in range(len(ids))]
            out.append(TrainSequence(ids, trainable, [0.0] * len(ids), 0.0, group_index=pair, preference=preference))
    return out[::-1]  # the rejected side first: the plan must not depend on the order


def test_pairs_stay_whole_in_steps_and_micro_batches() -> None:
    sequences = pairs_batch()
    config = DPOConfig(gradient_steps_per_epoch=3, micro_batch_tokens=64)
    steps = plan_job(sequences, config)
    assert len(steps) == 3 and sorted(i for step in steps for i in step) == list(range(8))
    for step in steps:
        assert set(Counter(sequences[i].group_index for i in step).values()) == {2}
        chosen = [sequences[i] for i in step]
        for plan in plan_step(chosen, config.micro_batch_tokens, share_prefixes=True):
            batch = collate([chosen[i] for i in plan.members], 0)
            assert batch.pairs is not None and batch.pairs.shape == (len(plan.members) // 2, 2)
            for chosen_row, rejected_row in batch.pairs.tolist():
                assert chosen[plan.members[chosen_row]].preference == 1
                assert chosen[plan.members[rejected_row]].preference == -1


def test_a_pair_with_a_long_shared_prompt_runs_it_once() -> None:
    sequences = pairs_batch(prompt=80)
    plans = plan_step(sequences, token_budget=4096, share_prefixes=True)
    # each pair is a family of two over its 79-token prompt; the four share one micro-batch
    assert [plan.families for plan in plans] == [((79, 2),) * 4]
    assert all(not plan.families for plan in plan_step(sequences, token_budget=4096, share_prefixes=False))


def test_half_a_pair_is_refused() -> None:
    sequences = pairs_batch()[:3]
    with pytest.raises(ValueError, match="preference pair"):
        validate_batch(sequences, VOCAB)


# ------------------------------------------------------------------------------------------- the loop


def run(model: torch.nn.Module, config: DPOConfig, sequences: list[TrainSequence]) -> list[StepEvent]:
    params = [p for p in model.parameters() if p.requires_grad]
    events: list[StepEvent] = []
    run_optimizer_steps(model, torch.optim.SGD(params, lr=config.learning_rate), sequences, config,
                        pad_token_id=0, on_step=events.append, reference=model.disable_adapter)  # type: ignore[arg-type]
    return events


def test_dpo_training_widens_the_margin_against_the_base_model() -> None:
    model = tiny_peft_model()
    config = DPOConfig(learning_rate=0.5, beta=0.5, epochs=6, micro_batch_tokens=64, max_grad_norm=None)
    events = run(model, config, pairs_batch())
    assert [e.objective for e in events] == ["dpo"] * 6
    margins = [e.metrics["reward_margin"] for e in events]
    assert margins[-1] > margins[0] + 0.5, margins
    assert events[-1].metrics["reward_accuracy"] == 1.0
    assert events[-1].loss < events[0].loss


def test_micro_batching_does_not_change_the_update() -> None:
    sequences = pairs_batch()
    config = DPOConfig(learning_rate=0.5, micro_batch_tokens=64, max_grad_norm=None)
    small, large = tiny_peft_model(), tiny_peft_model()
    [a] = run(small, config, sequences)
    [b] = run(large, config.model_copy(update={"micro_batch_tokens": 4096}), copy.deepcopy(sequences))
    # float32 sums in another order: equal to ~1e-7
    assert a.loss == pytest.approx(b.loss, rel=1e-5) and a.metrics == pytest.approx(b.metrics, rel=1e-4, abs=1e-6)
    for p, q in zip(small.parameters(), large.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------- bad requests


@pytest.mark.parametrize(("body", "loc"), [
    ({"config": {"objective": "dpo"}}, ("pairs",)),
    ({"config": {"objective": "dpo"}, "groups": [{"trajectories": [{"trajectory_id": "t", "reward": 1.0}]}],
      "pairs": [{"chosen_trajectory_id": "a", "rejected_trajectory_id": "b"}]}, ("groups",)),
    ({"pairs": [{"chosen_trajectory_id": "a", "rejected_trajectory_id": "b"}]}, ("groups",)),
    ({"config": {"objective": "dpo"}, "pairs": [{"chosen_trajectory_id": "a", "rejected_trajectory_id": "a"}]},
     ("pairs", 0, "recorded")),
    ({"config": {"objective": "dpo"}, "pairs": [{"prompt": [{"role": "user", "content": "hi"}], "chosen": "yes",
                                                 "rejected": [{"role": "assistant", "content": "yes"}]}]},
     ("pairs", 0, "messages")),
])
def test_requests_whose_data_dpo_cannot_use_are_refused(body: dict[str, object], loc: tuple[object, ...]) -> None:
    with pytest.raises(ValidationError) as bad:
        TrainRequest.model_validate({"model": "m", **body})
    assert bad.value.errors()[0]["loc"] == loc
    with pytest.raises(InvalidRequest) as http:  # what a client is told: the item, without the union's tag
        parse_train_request(orjson.dumps({"model": "m", **body}))
    assert http.value.param == ".".join(str(part) for part in loc[:2])


@pytest.mark.parametrize("options", [
    {"loss_type": "hinge", "label_smoothing": 0.1},
    {"reference_free": True, "reference": "m@3"},
    {"reference": "m"},  # a step is name@N
    {"label_smoothing": 0.5},
    {"loss_type": "kto"},
])
def test_bad_dpo_configs_are_rejected(options: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        train_config(objective="dpo", **options)


def test_a_string_answer_is_one_assistant_message() -> None:
    request = TrainRequest.model_validate({"model": "m", "config": {"objective": "dpo", "reference": "m@2"}, "pairs": [
        {"prompt": [{"role": "user", "content": "hi"}], "chosen": "hello", "rejected": "go away"}]})
    assert request.pairs[0].chosen == [{"role": "assistant", "content": "hello"}]  # type: ignore[union-attr]
    assert isinstance(request.config, DPOConfig) and request.config.reference == "m@2"
    assert copy.deepcopy(request) == request
