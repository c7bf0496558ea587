"""GRPO math on hand-computed examples (see the module docstrings of artlike_server.training.advantages and .grpo)."""

from __future__ import annotations

import doctest
import math

import pytest
import torch
from artlike_server.torch_worker.objectives.grpo import policy_loss
from artlike_server.training import advantages
from artlike_server.training.advantages import group_advantages, is_zero_variance

EPS_LOW, EPS_HIGH = 0.2, 0.28


def one_token_loss(ratio: float, advantage: float) -> tuple[float, float, float]:
    """(loss, d loss / d logπθ, clip_fraction) for a single trainable token with behaviour logprob log(0.5)."""
    behaviour = math.log(0.5)
    logprobs = torch.tensor([[behaviour + math.log(ratio)]], requires_grad=True)
    out = policy_loss(
        logprobs,
        torch.tensor([[behaviour]]),
        torch.tensor([advantage]),
        torch.tensor([[True]]),
        epsilon_low=EPS_LOW,
        epsilon_high=EPS_HIGH,
    )
    out.loss.backward()
    assert logprobs.grad is not None
    return out.loss.item(), float(logprobs.grad[0, 0]), float(out.clip_fraction)


# ------------------------------------------------------------------------------------- advantages


def test_advantages_of_two_winners_two_losers_are_plus_minus_one() -> None:
    # mean 0.5, population std 0.5 -> ±0.5 / (0.5 + 1e-4)
    expected = 0.5 / 0.5001
    assert group_advantages([1.0, 0.0, 0.0, 1.0]) == pytest.approx([expected, -expected, -expected, expected])


def test_advantages_use_the_population_std() -> None:
    # rewards 2, 4, 6: mean 4, population variance (4 + 0 + 4) / 3 = 8/3 (the sample std would use / 2)
    std = math.sqrt(8 / 3)
    assert group_advantages([2.0, 4.0, 6.0]) == pytest.approx([-2 / (std + 1e-4), 0.0, 2 / (std + 1e-4)])


def test_advantages_without_scaling_are_centred_rewards() -> None:
    assert group_advantages([3.0, 1.0, 2.0], scale_rewards=False) == pytest.approx([1.0, -1.0, 0.0])


def test_equal_rewards_give_zero_advantages_and_are_flagged() -> None:
    assert group_advantages([0.7, 0.7, 0.7]) == [0.0, 0.0, 0.0]
    assert is_zero_variance([0.7, 0.7, 0.7])
    assert is_zero_variance([5.0])
    assert not is_zero_variance([1.0, 1.0, 0.0])


# ----------------------------------------------------------------------------------- clipping cases


def test_positive_advantage_ratio_above_clip_is_clipped_and_has_no_gradient() -> None:
    # ρ = 1.5 > 1 + 0.28: min(1.5·1, 1.28·1) = 1.28 -> loss -1.28, constant in θ
    loss, grad, clipped = one_token_loss(1.5, 1.0)
    assert loss == pytest.approx(-1.28)
    assert grad == 0.0
    assert clipped == 1.0


def test_positive_advantage_ratio_below_clip_keeps_the_gradient() -> None:
    # ρ = 0.5 < 0.8: min(0.5, 0.8) = 0.5 -> loss -0.5; d(-ρA)/dlogπ = -ρA = -0.5
    loss, grad, clipped = one_token_loss(0.5, 1.0)
    assert loss == pytest.approx(-0.5)
    assert grad == pytest.approx(-0.5)
    assert clipped == 0.0


def test_negative_advantage_ratio_below_clip_is_clipped() -> None:
    # ρ = 0.5, A = -2: min(-1.0, 0.8·-2 = -1.6) = -1.6 -> loss 1.6, constant
    loss, grad, clipped = one_token_loss(0.5, -2.0)
    assert loss == pytest.approx(1.6)
    assert grad == 0.0
    assert clipped == 1.0


def test_negative_advantage_ratio_above_clip_is_not_clipped() -> None:
    # ρ = 1.5, A = -1: min(-1.5, -1.28) = -1.5 -> loss 1.5; gradient -ρA = 1.5 (pushes the ratio down)
    loss, grad, clipped = one_token_loss(1.5, -1.0)
    assert loss == pytest.approx(1.5)
    assert grad == pytest.approx(1.5)
    assert clipped == 0.0


def test_ratio_inside_the_clip_range_is_plain_importance_weighting() -> None:
    # ρ = 1.1, A = 2: loss -2.2, gradient -2.2
    loss, grad, clipped = one_token_loss(1.1, 2.0)
    assert loss == pytest.approx(-2.2)
    assert grad == pytest.approx(-2.2)
    assert clipped == 0.0


# ------------------------------------------------------------------------------------- aggregation


def two_sequences() -> dict[str, torch.Tensor]:
    """Sequence 0: 1 trainable token, A = +1. Sequence 1: 3 trainable tokens, A = -1. Ratio 1 everywhere,
    so every token's loss is -A: -1 for sequence 0's token, +1 for each of sequence 1's."""
    logprobs = torch.full((2, 4), -1.0, requires_grad=True)
    return {
        "logprobs": logprobs,
        "behaviour_logprobs": torch.full((2, 4), -1.0),
        "advantages": torch.tensor([1.0, -1.0]),
        "mask": torch.tensor([[False, False, False, True], [False, True, True, True]]),
    }


def test_token_aggregation_weighs_every_token_equally() -> None:
    out = policy_loss(**two_sequences(), epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH, aggregation="token")
    assert out.loss.item() == pytest.approx((-1 + 3 * 1) / 4)  # 0.5
    assert float(out.tokens) == 4


def test_sequence_aggregation_weighs_every_sequence_equally() -> None:
    out = policy_loss(**two_sequences(), epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH, aggregation="sequence")
    assert out.loss.item() == pytest.approx((-1 / 1 + 3 / 3) / 2, abs=1e-6)  # 0.0


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_micro_batches_with_the_step_normalizer_add_up_to_the_whole_batch(aggregation: str) -> None:
    batch = two_sequences()
    whole = policy_loss(**batch, epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH, aggregation=aggregation)  # type: ignore[arg-type]
    whole.loss.backward()
    whole_grad = batch["logprobs"].grad.clone()

    logprobs = batch["logprobs"].detach().clone().requires_grad_(True)
    normalizer = 4 if aggregation == "token" else 2
    total = 0.0
    for row in (0, 1):
        part = policy_loss(
            logprobs[row : row + 1],
            batch["behaviour_logprobs"][row : row + 1],
            batch["advantages"][row : row + 1],
            batch["mask"][row : row + 1],
            epsilon_low=EPS_LOW,
            epsilon_high=EPS_HIGH,
            aggregation=aggregation,  # type: ignore[arg-type]
            normalizer=normalizer,
        )
        part.loss.backward()
        total += part.loss.item()
    assert total == pytest.approx(whole.loss.item(), abs=1e-6)
    assert torch.allclose(logprobs.grad, whole_grad)


# -------------------------------------------------------------------------------------- KL and masks


def test_k3_kl_to_the_reference_on_a_small_example() -> None:
    # logπθ = log 0.5, logπ_ref = log 0.25: d = ref - θ = log 0.5; k3 = e^d - d - 1 = 0.5 + ln 2 - 1
    k3 = 0.5 + math.log(2) - 1  # 0.19315
    out = policy_loss(
        torch.tensor([[math.log(0.5)]]),
        torch.tensor([[math.log(0.5)]]),
        torch.tensor([1.0]),
        torch.tensor([[True]]),
        epsilon_low=EPS_LOW,
        epsilon_high=EPS_HIGH,
        ref_logprobs=torch.tensor([[math.log(0.25)]]),
        kl_beta=0.1,
    )
    assert float(out.kl) == pytest.approx(k3)
    assert float(out.policy_loss) == pytest.approx(-1.0)  # ratio 1, A = 1
    assert out.loss.item() == pytest.approx(-1.0 + 0.1 * k3)


def test_kl_is_zero_when_the_policy_equals_the_reference() -> None:
    lp = torch.tensor([[-0.3, -2.0]])
    out = policy_loss(
        lp, lp, torch.tensor([1.0]), torch.tensor([[True, True]]),
        epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH, ref_logprobs=lp, kl_beta=1.0,
    )  # fmt: skip
    assert float(out.kl) == 0.0


def test_masked_tokens_get_no_gradient_and_do_not_change_the_loss() -> None:
    mask = torch.tensor([[False, True, False, True]])
    behaviour = torch.tensor([[0.0, -1.0, 0.0, -2.0]])  # 0.0 where not trainable, as in a TrainSequence
    values = torch.tensor([[-30.0, -0.9, -7.0, -2.1]])
    logprobs = values.clone().requires_grad_(True)
    out = policy_loss(
        logprobs, behaviour, torch.tensor([1.5]), mask, epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH
    )
    out.loss.backward()
    assert logprobs.grad is not None
    assert logprobs.grad[0, 0] == 0.0 and logprobs.grad[0, 2] == 0.0
    assert logprobs.grad[0, 1] != 0.0 and logprobs.grad[0, 3] != 0.0

    other = values.clone()
    other[0, 0], other[0, 2] = -1.0, -50.0  # change only masked positions
    again = policy_loss(
        other, behaviour, torch.tensor([1.5]), mask, epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH
    )
    assert again.loss.item() == out.loss.item()


def test_unknown_behaviour_logprobs_mean_on_policy() -> None:
    # NaN behaviour -> ratio 1 -> loss -A, and the token is left out of the mismatch metric
    logprobs = torch.tensor([[-1.0, -3.0]], requires_grad=True)
    out = policy_loss(
        logprobs,
        torch.tensor([[math.nan, -2.0]]),
        torch.tensor([2.0]),
        torch.tensor([[True, True]]),
        epsilon_low=EPS_LOW,
        epsilon_high=EPS_HIGH,
    )
    # token 0: ratio 1 -> -2; token 1: ratio e^-1 = 0.368 < 0.8, A > 0 -> unclipped -0.736
    assert out.loss.item() == pytest.approx((-2.0 - 2.0 * math.exp(-1.0)) / 2)
    assert float(out.logprob_mismatch) == pytest.approx(1.0)
    assert float(out.mismatch_tokens) == 1
    out.loss.backward()
    assert logprobs.grad is not None and torch.isfinite(logprobs.grad).all()
    assert float(logprobs.grad[0, 0]) == pytest.approx(-2.0 / 2)  # d(-ρA)/dlogπ at ρ = 1, over 2 tokens


def test_a_wildly_wrong_behaviour_logprob_keeps_the_loss_finite() -> None:
    logprobs = torch.tensor([[-0.1]], requires_grad=True)
    out = policy_loss(
        logprobs, torch.tensor([[-500.0]]), torch.tensor([-1.0]), torch.tensor([[True]]),
        epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH,
    )  # fmt: skip
    out.loss.backward()
    assert math.isfinite(out.loss.item())
    assert logprobs.grad is not None and torch.isfinite(logprobs.grad).all()


def test_positive_weight_scales_only_the_positive_advantages() -> None:
    # one right of four: mean 0.25, population std √0.1875 ≈ 0.4330; W-REINFORCE's λ = 0.1 on the right one
    std = math.sqrt(0.1875) + 1e-4
    assert group_advantages([1.0, 0.0, 0.0, 0.0], positive_weight=0.1) == pytest.approx(
        [0.1 * 0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std])
    assert group_advantages([1.0, 0.0], scale_rewards=False, positive_weight=0.0) == [0.0, -0.5]  # only the wrong
    assert group_advantages([0.5, 0.5], positive_weight=0.1) == [0.0, 0.0]


def test_advantages_doctests() -> None:
    assert doctest.testmod(advantages, raise_on_error=True).attempted >= 2
