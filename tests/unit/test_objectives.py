"""The objective seam and the GRPO family beyond GRPO itself: CISPO, GSPO and Dr. GRPO's constant normaliser,
on hand-computed examples (see each module's docstring), gradient checks, the config union, and the loop
running every objective."""

from __future__ import annotations

import math

import orjson
import pytest
import torch
from artlike_server.torch_worker.loop import run_optimizer_steps
from artlike_server.torch_worker.objectives import PolicyBatch, build_objective
from artlike_server.torch_worker.objectives.cispo import cispo_loss
from artlike_server.torch_worker.objectives.grpo import policy_loss
from artlike_server.torch_worker.objectives.gspo import gspo_loss
from artlike_server.torch_worker.objectives.tokens import step_normalizer
from artlike_server.trainer_ipc.sequences import TrainSequence
from pydantic import ValidationError

from artlike.types import (
    OBJECTIVES,
    CISPOConfig,
    DPOConfig,
    GRPOConfig,
    GSPOConfig,
    ImportanceSamplingConfig,
    PPOConfig,
    RewardModelConfig,
    SFTConfig,
    StepEvent,
    TrainRequest,
    train_config,
)

from .test_training_loop import batch, tiny_peft_model


def leaf(values: list[list[float]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


# ------------------------------------------------------------------------------------------------ CISPO


def test_cispo_keeps_the_gradient_grpo_clips_away() -> None:
    # ratios 2.0 and 1.0, A = 1, ε_low = 1 (no lower bound), ε_high = 0.28: weights 1.28 and 1.0
    logprobs = leaf([[math.log(0.5), math.log(0.2)]])
    behaviour = torch.tensor([[math.log(0.25), math.log(0.2)]], dtype=torch.float64)
    mask = torch.tensor([[True, True]])
    out = cispo_loss(logprobs, behaviour, torch.tensor([1.0]), mask, epsilon_low=1.0, epsilon_high=0.28)
    assert float(out.loss.detach()) == pytest.approx(-(1.28 + 1.0) / 2)
    out.loss.backward()
    assert logprobs.grad is not None
    assert logprobs.grad.flatten().tolist() == pytest.approx([-1.28 / 2, -1.0 / 2])  # -w·A / N_tokens
    assert (float(out.clipped), float(out.tokens)) == (1.0, 2.0)
    total, count = out.metrics["is_weight"]
    assert float(total / count) == pytest.approx(1.14)

    # GRPO on the same tokens: the ratio-2 token is outside the trust region and gets no gradient.
    grpo_logprobs = leaf([[math.log(0.5), math.log(0.2)]])
    policy_loss(grpo_logprobs, behaviour, torch.tensor([1.0]), mask, epsilon_low=0.2, epsilon_high=0.28).loss.backward()
    assert grpo_logprobs.grad is not None and grpo_logprobs.grad[0, 0] == 0.0


def test_cispo_bounds_the_weight_from_below_when_asked() -> None:
    logprobs = leaf([[math.log(0.1)]])
    behaviour = torch.tensor([[math.log(0.4)]], dtype=torch.float64)  # ratio 0.25
    out = cispo_loss(logprobs, behaviour, torch.tensor([-2.0]), torch.tensor([[True]]), epsilon_low=0.2,
                     epsilon_high=0.28)
    out.loss.backward()
    assert logprobs.grad is not None and float(logprobs.grad[0, 0]) == pytest.approx(0.8 * 2.0)  # -w·A, w = 0.8


# ------------------------------------------------------------------------------------------------- GSPO


def test_gspo_clips_whole_sequences_on_their_geometric_mean_ratio() -> None:
    # sequence 0: token log-ratios 0.3 and -0.1 -> s = e^0.1, A = 1: clipped at 1 + 4e-4, no gradient
    # sequence 1: three tokens at ratio 1, A = -0.5 -> loss 0.5, gradient -A·s/n per token, over N = 2 sequences
    behaviour = torch.tensor([[-1.3, -0.9, 0.0], [-1.0, -2.0, -3.0]], dtype=torch.float64)
    logprobs = leaf([[-1.0, -1.0, 0.0], [-1.0, -2.0, -3.0]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    out = gspo_loss(logprobs, behaviour, torch.tensor([1.0, -0.5]), mask, epsilon_low=3e-4, epsilon_high=4e-4)
    assert float(out.loss.detach()) == pytest.approx((-(1 + 4e-4) + 0.5) / 2)
    out.loss.backward()
    assert logprobs.grad is not None
    assert logprobs.grad[0].tolist() == [0.0, 0.0, 0.0]
    assert logprobs.grad[1].tolist() == pytest.approx([0.5 / 3 / 2] * 3)
    assert (float(out.clipped), float(out.tokens)) == (2.0, 5.0)  # the clipped sequence's tokens
    total, count = out.metrics["sequence_ratio"]
    assert float(total / count) == pytest.approx((math.exp(0.1) + 1.0) / 2)


def test_gspo_gradient_of_an_unclipped_sequence_is_the_mean_token_score() -> None:
    logprobs = leaf([[-1.0, -2.0]])
    behaviour = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    out = gspo_loss(logprobs, behaviour, torch.tensor([2.0]), torch.tensor([[True, True]]), epsilon_low=0.2,
                    epsilon_high=0.2)
    out.loss.backward()
    assert logprobs.grad is not None and logprobs.grad.flatten().tolist() == pytest.approx([-1.0, -1.0])  # -A·s/n


# ---------------------------------------------------------------------------------------------- Dr. GRPO


def test_dr_grpo_divides_by_sequences_times_a_constant_not_by_length() -> None:
    # lengths 1 and 3 at ratio 1, A = +1 and -1: Σ_t -A_t = -1 + 3 = 2, over 2 sequences × 10
    logprobs = leaf([[-1.0, 0.0, 0.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[True, False, False], [True, True, True]])
    out = policy_loss(logprobs, logprobs.detach().clone(), torch.tensor([1.0, -1.0]), mask, epsilon_low=0.2,
                      epsilon_high=0.28, aggregation="constant", loss_normalizer=10)
    assert float(out.loss.detach()) == pytest.approx(2 / 20)
    out.loss.backward()
    assert logprobs.grad is not None
    assert logprobs.grad.flatten().tolist() == pytest.approx([-1 / 20, 0, 0, 1 / 20, 1 / 20, 1 / 20])
    assert step_normalizer([1, 3, 0], "constant", 10) == 20


# ----------------------------------------------------------------------------------------- gradient checks


@pytest.mark.parametrize("name", ["grpo", "cispo", "gspo"])
def test_analytic_gradients_match_finite_differences(name: str) -> None:
    g = torch.Generator().manual_seed(0)
    behaviour = -torch.rand(2, 4, generator=g, dtype=torch.float64) - 0.5
    start = behaviour + 0.05 * torch.randn(2, 4, generator=g, dtype=torch.float64)  # ratios near 1: no kinks
    mask = torch.tensor([[True, True, True, False], [True, True, True, True]])
    advantages = torch.tensor([0.7, -1.3], dtype=torch.float64)
    ref = behaviour - 0.1

    def loss(logprobs: torch.Tensor) -> torch.Tensor:
        if name == "grpo":
            return policy_loss(logprobs, behaviour, advantages, mask, epsilon_low=0.5, epsilon_high=0.5,
                               ref_logprobs=ref, kl_beta=0.1).loss
        if name == "cispo":
            return cispo_loss(logprobs, behaviour, advantages, mask, epsilon_low=0.5, epsilon_high=0.5,
                              ref_logprobs=ref, kl_beta=0.1).loss
        return gspo_loss(logprobs, behaviour, advantages, mask, epsilon_low=0.5, epsilon_high=0.5, ref_logprobs=ref,
                         kl_beta=0.1).loss

    assert torch.autograd.gradcheck(loss, (start.clone().requires_grad_(True),))


# ------------------------------------------------------------------------------------------- the configs


def test_the_config_union_picks_the_objective_and_defaults_to_grpo() -> None:
    assert isinstance(train_config(), GRPOConfig)
    assert isinstance(train_config(objective="cispo"), CISPOConfig)
    request = TrainRequest.model_validate({"model": "m", "groups": [{"trajectories": [
        {"trajectory_id": "t1", "reward": 1.0}]}], "config": {"objective": "gspo", "epsilon_high": 1e-3}})
    assert isinstance(request.config, GSPOConfig) and request.config.epsilon_high == 1e-3
    assert isinstance(TrainRequest.model_validate({"model": "m", "groups": [{"trajectories": [
        {"trajectory_id": "t1", "reward": 1.0}]}]}).config, GRPOConfig)


@pytest.mark.parametrize("options", [
    {"objective": "ppo2"},
    {"objective": "gspo", "loss_aggregation": "token"},  # GSPO is sequence-level by definition
    {"loss_aggregation": "constant"},  # needs loss_normalizer
    {"objective": "cispo", "epsilon_hi": 0.3},  # typo: unknown fields are errors
    {"clip_cov_range": [5.0, 1.0]},  # Clip-Cov's bounds must be (low, high)
    {"clip_cov_fraction": 1.5},
    {"objective": "cispo", "clip_cov_fraction": 0.1},  # Clip-Cov is a GRPO option
    {"positive_advantage_weight": -0.5},  # a weight, not a sign flip
])
def test_bad_configs_are_rejected(options: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        train_config(**options)


# ---------------------------------------------------------------------------------------------- the loop


@pytest.mark.parametrize(("config", "metric"), [
    (GRPOConfig(learning_rate=0.1, micro_batch_tokens=64, max_grad_norm=None), None),
    (GRPOConfig(learning_rate=0.1, micro_batch_tokens=64, max_grad_norm=None, clip_cov_fraction=0.5,
                clip_cov_range=(-100.0, 100.0)), "clip_cov_fraction"),
    (CISPOConfig(learning_rate=0.1, micro_batch_tokens=64, max_grad_norm=None), "is_weight"),
    (GSPOConfig(learning_rate=0.1, micro_batch_tokens=64, max_grad_norm=None, kl_beta=0.05), "sequence_ratio"),
])
def test_the_loop_trains_every_objective_and_reports_its_metrics(config: GRPOConfig, metric: str | None) -> None:
    model = tiny_peft_model()
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    events: list[StepEvent] = []
    reference = model.disable_adapter  # the base model is the reference policy
    run_optimizer_steps(model, torch.optim.SGD(params, lr=0.1), batch(), config, pad_token_id=0,
                        on_step=events.append, reference=reference)  # type: ignore[arg-type]
    [event] = events
    assert event.objective == config.objective and math.isfinite(event.loss) and event.grad_norm > 0
    assert set(event.metrics) == ({metric} if metric else set())
    assert any(not torch.equal(a, b) for a, b in zip(before, params, strict=True))
    assert build_objective(config).needs_reference == (config.kl_beta > 0)


def test_the_seam_hands_objectives_what_they_ask_for() -> None:
    objective = build_objective(GRPOConfig(kl_beta=0.1))
    logprobs = leaf([[-1.0, -2.0]])
    batch_ = PolicyBatch(logprobs, torch.tensor([[True, True]]), torch.tensor([[-1.0, float("nan")]]),
                         torch.tensor([1.0]), ref_logprobs=torch.tensor([[-1.0, -2.0]]))
    out = objective.loss(batch_, objective.normalizer([TrainSequence([0, 1, 2], [False, True, True], [0.0] * 3, 1.0)]))
    assert float(out.kl) == 0.0 and float(out.mismatch_tokens) == 1.0  # NaN behaviour: not counted
    assert float(out.policy_loss) == pytest.approx(-1.0)


def test_a_bad_config_field_is_named_as_the_caller_sent_it() -> None:
    from artlike_server.errors import InvalidRequest
    from artlike_server.training.api_router import parse_train_request

    group = {"trajectories": [{"trajectory_id": "a", "reward": 1.0}, {"trajectory_id": "b", "reward": 0.0}]}
    for config, param in (({"learning_rate": -1}, "config.learning_rate"),
                          ({"objective": "cispo", "epsilon_high": "x"}, "config.epsilon_high")):
        with pytest.raises(InvalidRequest) as bad:
            parse_train_request(orjson.dumps({"model": "m", "groups": [group], "config": config}))
        assert bad.value.param == param
    configs = (GRPOConfig, CISPOConfig, GSPOConfig, ImportanceSamplingConfig, SFTConfig, DPOConfig, RewardModelConfig,
               PPOConfig)
    assert set(OBJECTIVES) == {config.model_fields["objective"].default for config in configs}
