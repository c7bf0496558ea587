"""Clip-Cov on hand-computed examples (see artlike_server.torch_worker.objectives.clip_cov): which tokens leave the
loss, that they lose their gradient and nothing else changes, and the budget."""

from __future__ import annotations

import doctest

import pytest
import torch
from artlike_server.torch_worker.objectives import clip_cov
from artlike_server.torch_worker.objectives.clip_cov import covariance, tokens_to_exclude
from artlike_server.torch_worker.objectives.grpo import policy_loss

# Two sequences of three trainable tokens. Sequence 0 was punished (A = −1), sequence 1 rewarded (A = +1), so
# mean A = 0; mean logπθ = (−0.1 − 2.0 − 3.0 − 0.1 − 0.2 − 0.3) / 6 = −0.95.
LOGPROBS = [[-0.1, -2.0, -3.0], [-0.1, -0.2, -0.3]]
ADVANTAGES = torch.tensor([-1.0, 1.0])
MASK = torch.ones(2, 3, dtype=torch.bool)
NONE_CLIPPED = torch.zeros(2, 3, dtype=torch.bool)


def test_doctests() -> None:
    assert doctest.testmod(clip_cov).failed == 0


def test_the_covariance_of_each_token_on_a_worked_example() -> None:
    cov = covariance(torch.tensor(LOGPROBS), ADVANTAGES, MASK)
    # sequence 0: −1 · (logπ + 0.95); sequence 1: +1 · (logπ + 0.95)
    expected = torch.tensor([[-0.85, 1.05, 2.05], [0.85, 0.75, 0.65]])
    assert torch.allclose(cov, expected, atol=1e-6)


def test_masked_tokens_neither_count_in_the_means_nor_get_a_covariance() -> None:
    mask = torch.tensor([[True, True, False], [True, True, True]])
    cov = covariance(torch.tensor(LOGPROBS), ADVANTAGES, mask)
    # five tokens: mean A = (−2 + 3) / 5 = 0.2; mean logπθ = −2.7 / 5 = −0.54
    assert float(cov[0, 2]) == 0.0
    assert float(cov[0, 1]) == pytest.approx((-1.0 - 0.2) * (-2.0 + 0.54))
    assert float(cov[1, 0]) == pytest.approx((1.0 - 0.2) * (-0.1 + 0.54))


def test_only_tokens_inside_the_bounds_are_candidates_and_the_budget_holds() -> None:
    logprobs = torch.tensor(LOGPROBS)
    # the budget covers every candidate: exactly the two tokens with 1 < cov < 5 leave
    excluded = tokens_to_exclude(logprobs, ADVANTAGES, MASK, NONE_CLIPPED, fraction=0.5, low=1.0, high=5.0)
    assert excluded.tolist() == [[False, True, True], [False, False, False]]
    # an upper bound of 2 leaves only the first of them
    excluded = tokens_to_exclude(logprobs, ADVANTAGES, MASK, NONE_CLIPPED, fraction=0.5, low=1.0, high=2.0)
    assert excluded.tolist() == [[False, True, False], [False, False, False]]
    # a budget of one token (at least one whatever the fraction) picks one of the two at random
    for seed in range(8):
        generator = torch.Generator().manual_seed(seed)
        excluded = tokens_to_exclude(logprobs, ADVANTAGES, MASK, NONE_CLIPPED, fraction=1e-4, low=1.0, high=5.0,
                                     generator=generator)
        assert int(excluded.sum()) == 1 and bool(excluded[0, 1] or excluded[0, 2])


def test_tokens_the_ppo_clip_limited_and_a_fraction_of_zero_leave_nothing_out() -> None:
    logprobs = torch.tensor(LOGPROBS)
    clipped = torch.tensor([[False, True, True], [False, False, False]])
    assert not tokens_to_exclude(logprobs, ADVANTAGES, MASK, clipped, fraction=0.5, low=1.0, high=5.0).any()
    assert not tokens_to_exclude(logprobs, ADVANTAGES, MASK, NONE_CLIPPED, fraction=0.0, low=1.0, high=5.0).any()


def test_in_the_grpo_loss_the_excluded_tokens_lose_their_gradient_and_the_rest_train_as_before() -> None:
    behaviour = torch.tensor(LOGPROBS)  # on policy: every ratio is 1, nothing clipped

    def run(fraction: float) -> tuple[torch.Tensor, torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        logprobs = torch.tensor(LOGPROBS, requires_grad=True)
        out = policy_loss(logprobs, behaviour, ADVANTAGES, MASK, epsilon_low=0.2, epsilon_high=0.28,
                          clip_cov_fraction=fraction, clip_cov_range=(1.0, 5.0))
        out.loss.backward()
        assert logprobs.grad is not None
        return out.loss.detach(), logprobs.grad, out.metrics

    plain_loss, plain_grad, plain_metrics = run(0.0)
    loss, grad, metrics = run(0.5)
    # plain GRPO on policy: d loss / d logπ_t = −A_t / 6 tokens
    assert torch.allclose(plain_grad, torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]]) / 6)
    assert grad[0, 1] == 0.0 and grad[0, 2] == 0.0
    keep = torch.tensor([[True, False, False], [True, True, True]])
    assert torch.equal(grad[keep], plain_grad[keep])
    # the loss of the kept tokens, still divided by all six: (+1 (seq 0, one token) − 3 (seq 1)) / 6
    assert float(plain_loss) == pytest.approx(0.0) and float(loss) == pytest.approx(-2.0 / 6)
    excluded, tokens = metrics["clip_cov_fraction"]
    assert (float(excluded), float(tokens)) == (2.0, 6.0) and plain_metrics == {}
