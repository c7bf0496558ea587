"""PPO on the objective seam: GAE, the KL-shaped rewards, whitening, the adaptive KL controller, the clipped
policy and value losses on hand-computed examples (ppo.py's docstring), `PPO.prepare` on hand-made passes,
the entropy bonus's gradient (`SelectedLogprobs`), and the loop training a tiny policy with its value head."""

from __future__ import annotations

import copy
import doctest
import math
import statistics
from collections.abc import Callable

import pytest
import torch
from artlike_server.torch_worker.heads import ValueHead
from artlike_server.torch_worker.logprobs import SelectedLogprobs, decoder_states, logprobs_from_states
from artlike_server.torch_worker.loop import run_optimizer_steps, validate_batch
from artlike_server.torch_worker.objectives import JobPasses, PolicyBatch, build_objective, ppo
from artlike_server.torch_worker.objectives.ppo import (
    KL_COEF_STATE,
    PPO,
    adaptive_kl_coef,
    explained_variance,
    gae,
    ppo_loss,
    token_rewards,
    value_loss,
    whiten,
)
from artlike_server.trainer_ipc.sequences import TrainSequence
from torch.nn import functional as F

from artlike.types import PPOConfig, StepEvent

from .test_training_loop import VOCAB, batch, reference_logprobs, tiny_peft_model

NAN = math.nan


def f64(values: list[float] | list[list[float]], grad: bool = False) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, requires_grad=grad)


def f32(values: list[float]) -> torch.Tensor:
    """A pass's per-sequence tensor: float32, as `JobPasses` hands them."""
    return torch.tensor(values, dtype=torch.float32)


def test_doctests() -> None:
    assert doctest.testmod(ppo).failed == 0


# ---------------------------------------------------------------------------------------- GAE and rewards


def test_gae_worked_example_with_discount_and_lambda() -> None:
    # γ = 0.9, λ = 0.8 (γλ = 0.72); rewards (0, 0.5, 1), values (0.2, 0.4, 0.6), V after the last step = 0:
    # δ₂ = 1 + 0 − 0.6 = 0.4                 A₂ = 0.4
    # δ₁ = 0.5 + 0.9·0.6 − 0.4 = 0.64         A₁ = 0.64 + 0.72·0.4 = 0.928
    # δ₀ = 0 + 0.9·0.4 − 0.2 = 0.16           A₀ = 0.16 + 0.72·0.928 = 0.82816
    # returns A + V = (1.02816, 1.328, 1.0)
    advantages, returns = gae(f64([0.0, 0.5, 1.0]), f64([0.2, 0.4, 0.6]), gamma=0.9, lam=0.8)
    assert advantages.tolist() == pytest.approx([0.82816, 0.928, 0.4], abs=1e-12)
    assert returns.tolist() == pytest.approx([1.02816, 1.328, 1.0], abs=1e-12)


def test_gae_with_gamma_and_lambda_one_is_monte_carlo() -> None:
    # rewards (1, −2, 3): the return from each step is the sum of what is left: (2, 1, 3); A = return − V
    advantages, returns = gae(f64([1.0, -2.0, 3.0]), f64([0.5, 1.0, -1.0]), gamma=1.0, lam=1.0)
    assert returns.tolist() == pytest.approx([2.0, 1.0, 3.0], abs=1e-12)
    assert advantages.tolist() == pytest.approx([1.5, 0.0, 4.0], abs=1e-12)


def test_gae_with_lambda_zero_is_the_one_step_td_error() -> None:
    # λ = 0: A_t = δ_t = r_t + γ·V_{t+1} − V_t with γ = 0.5: (1 + 0.5·2 − 1, 0 + 0.5·4 − 2, 2 + 0 − 4) = (1, 0, −2)
    advantages, _ = gae(f64([1.0, 0.0, 2.0]), f64([1.0, 2.0, 4.0]), gamma=0.5, lam=0.0)
    assert advantages.tolist() == pytest.approx([1.0, 0.0, -2.0], abs=1e-12)


def test_token_rewards_penalise_every_step_and_pay_the_score_at_the_last() -> None:
    kl = f64([0.2, -0.1, 0.4])
    # −β·kl with β = 0.5: (−0.1, 0.05, −0.2), plus the score 2 at the last step: 1.8
    assert token_rewards(kl, 2.0, 0.5).tolist() == pytest.approx([-0.1, 0.05, 1.8], abs=1e-12)
    assert kl.tolist() == [0.2, -0.1, 0.4]  # the input is not modified
    assert token_rewards(f64([0.3]), -1.0, 0.0).tolist() == [-1.0]  # β = 0: only the score


def test_whiten_to_zero_mean_and_unit_population_std() -> None:
    # (1, 2, 3, 4): mean 2.5, population std √1.25 = 1.118034; (x − 2.5)/1.118034 = ∓1.341641, ∓0.447214
    got = whiten(f64([1.0, 2.0, 3.0, 4.0]))
    assert got.tolist() == pytest.approx([-1.341641, -0.447214, 0.447214, 1.341641], abs=1e-6)
    assert whiten(f64([3.0])).tolist() == [0.0]  # one value: centred only
    assert whiten(f64([2.0, 2.0, 2.0])).tolist() == [0.0, 0.0, 0.0]  # no spread: zeros, not NaN


def test_adaptive_kl_coefficient_moves_toward_the_target_from_both_sides() -> None:
    # KL 0.011 against 0.01: error +0.1, n/horizon = 50/1000: β·(1 + 0.1·0.05) = 0.1·1.005
    assert adaptive_kl_coef(0.1, 0.011, target=0.01, horizon=1000, n_steps=50) == pytest.approx(0.1005, abs=1e-12)
    # KL 0.009: error −0.1: 0.1·0.995
    assert adaptive_kl_coef(0.1, 0.009, target=0.01, horizon=1000, n_steps=50) == pytest.approx(0.0995, abs=1e-12)
    assert adaptive_kl_coef(0.1, 0.01, target=0.01, horizon=1000, n_steps=50) == pytest.approx(0.1, abs=1e-12)


def test_adaptive_kl_error_is_clipped_and_scales_with_the_sequences() -> None:
    # KL 100× the target: error clipped to +0.2: 0.1·(1 + 0.2·0.05) = 0.101; KL 0: −0.2: 0.099
    assert adaptive_kl_coef(0.1, 1.0, target=0.01, horizon=1000, n_steps=50) == pytest.approx(0.101, abs=1e-12)
    assert adaptive_kl_coef(0.1, 0.0, target=0.01, horizon=1000, n_steps=50) == pytest.approx(0.099, abs=1e-12)
    # twice the sequences, twice the move: 0.1·(1 + 0.2·0.1) = 0.102; a horizon of n: ×1.2 at once
    assert adaptive_kl_coef(0.1, 1.0, target=0.01, horizon=1000, n_steps=100) == pytest.approx(0.102, abs=1e-12)
    assert adaptive_kl_coef(0.1, 1.0, target=0.01, horizon=100, n_steps=100) == pytest.approx(0.12, abs=1e-12)


def test_explained_variance() -> None:
    actual = f64([1.0, 2.0, 3.0, 4.0])  # population variance 1.25
    assert explained_variance(actual.clone(), actual) == pytest.approx(1.0, abs=1e-12)
    assert explained_variance(torch.full((4,), 2.5, dtype=torch.float64), actual) == pytest.approx(0.0, abs=1e-12)
    # residuals (0, 0, 0, −1): variance 0.25 − 0.0625 = 0.1875; 1 − 0.1875/1.25 = 0.85
    assert explained_variance(f64([1.0, 2.0, 3.0, 5.0]), actual) == pytest.approx(0.85, abs=1e-12)
    assert math.isnan(explained_variance(f64([0.0, 1.0]), f64([2.0, 2.0])))


# ---------------------------------------------------------------------------------------- losses


def test_value_loss_clips_around_the_old_value() -> None:
    # per token (V, V_old, R), clip 0.2:
    #   (1, 0, 1):    unclipped 0, clipped (0.2 − 1)² = 0.64 → ½·0.64 = 0.32, the clipped branch
    #   (1, 0, −1):   unclipped 2² = 4, clipped (0.2 + 1)² = 1.44 → ½·4 = 2
    #   (0.1, 0, 1):  inside the clip range: both 0.81 → 0.405
    #   (−1, 0, −1):  unclipped 0, clipped (−0.2 + 1)² = 0.64 → 0.32, clipped
    values = f64([[1.0, 1.0, 0.1, -1.0]], grad=True)
    old = f64([[0.0, 0.0, 0.0, 0.0]])
    returns = f64([[1.0, -1.0, 1.0, -1.0]])
    per_token, clipped = value_loss(values, old, returns, 0.2)
    assert per_token.tolist()[0] == pytest.approx([0.32, 2.0, 0.405, 0.32], abs=1e-12)
    assert clipped.tolist() == [[True, False, False, True]]
    per_token.sum().backward()
    # where the clipped branch wins V is outside the range and gets no gradient; elsewhere V − R
    assert values.grad is not None
    assert values.grad.tolist()[0] == pytest.approx([0.0, 2.0, -0.9, 0.0], abs=1e-12)
    unclipped, flags = value_loss(values.detach(), old, returns, None)
    assert unclipped.tolist()[0] == pytest.approx([0.0, 2.0, 0.405, 0.0], abs=1e-12)  # ½(V − R)²
    assert not bool(flags.any())


def ppo_inputs(logprobs: torch.Tensor, **overrides: object) -> dict[str, object]:
    zeros = torch.zeros_like(logprobs, dtype=torch.float64)
    inputs: dict[str, object] = {
        "behaviour_logprobs": zeros, "mask": torch.ones(logprobs.shape, dtype=torch.bool), "advantages": zeros,
        "returns": zeros, "values": zeros, "old_values": zeros, "clip_ratio": 0.2, "value_clip": 0.2,
        "value_coef": 0.0, "normalizer": float(logprobs.numel()),
    }  # fmt: skip
    inputs.update(overrides)
    return inputs


def test_ppo_policy_loss_clips_the_ratio_for_both_signs_of_the_advantage() -> None:
    # behaviour p = 0.5; current 0.75 (ρ = 1.5) or 0.25 (ρ = 0.5); ε = 0.2:
    #   ρ 1.5, A +1: min(1.5, 1.2) = 1.2   → −1.2, clipped, no gradient
    #   ρ 0.5, A +1: min(0.5, 0.8) = 0.5   → −0.5, gradient −A·ρ = −0.5
    #   ρ 1.5, A −1: min(−1.5, −1.2) = −1.5 → 1.5, gradient −A·ρ = 1.5
    #   ρ 0.5, A −1: min(−0.5, −0.8) = −0.8 → 0.8, clipped, no gradient
    # loss (−1.2 − 0.5 + 1.5 + 0.8) / 4 tokens = 0.15
    logprobs = f64([[math.log(0.75), math.log(0.25), math.log(0.75), math.log(0.25)]], grad=True)
    behaviour = torch.full((1, 4), math.log(0.5), dtype=torch.float64)
    out = ppo_loss(logprobs, **ppo_inputs(logprobs, behaviour_logprobs=behaviour,  # type: ignore[arg-type]
                                          advantages=f64([[1.0, 1.0, -1.0, -1.0]])))
    assert float(out.loss.detach()) == pytest.approx(0.15, abs=1e-12)
    assert float(out.policy_loss) == pytest.approx(0.15, abs=1e-12)
    assert float(out.clipped) == 2.0 and float(out.tokens) == 4.0
    out.loss.backward()
    assert logprobs.grad is not None
    assert logprobs.grad.tolist()[0] == pytest.approx([0.0, -0.5 / 4, 1.5 / 4, 0.0], abs=1e-12)
    # |logπ − logπ_b| = log 1.5 and log 2 twice each
    assert float(out.logprob_mismatch) == pytest.approx((math.log(1.5) + math.log(2.0)) / 2, abs=1e-12)


def test_ppo_unknown_behaviour_logprobs_train_on_policy() -> None:
    # NaN behaviour: ρ = 1, the loss is −A and the token is not counted in the mismatch
    logprobs = f64([[-1.0, -2.0]], grad=True)
    out = ppo_loss(logprobs, **ppo_inputs(logprobs, behaviour_logprobs=f64([[NAN, -2.0]]),  # type: ignore[arg-type]
                                          advantages=f64([[2.0, 0.0]])))
    assert float(out.loss.detach()) == pytest.approx(-2.0 / 2, abs=1e-12)
    assert float(out.mismatch_tokens) == 1.0 and float(out.clipped) == 0.0


def test_ppo_value_term_is_weighted_by_value_coef_and_masked_tokens_count_nothing() -> None:
    # tokens (V, V_old, R): (1, 0, 1) → 0.32 (clipped), (0, 0, 1) → ½·1 = 0.5; a third, masked token with
    # huge numbers adds nothing. value_loss = (0.32 + 0.5)/2 = 0.41, × value_coef 0.5 = 0.205
    values = f64([[1.0, 0.0, 50.0]], grad=True)
    logprobs = f64([[-1.0, -1.0, -1.0]], grad=True)
    out = ppo_loss(logprobs, **ppo_inputs(  # type: ignore[arg-type]
        logprobs, behaviour_logprobs=f64([[-1.0, -1.0, -1.0]]), mask=torch.tensor([[True, True, False]]),
        advantages=f64([[0.0, 0.0, 100.0]]), returns=f64([[1.0, 1.0, -50.0]]), values=values,
        old_values=f64([[0.0, 0.0, 0.0]]), value_coef=0.5, normalizer=2.0))
    assert float(out.loss.detach()) == pytest.approx(0.205, abs=1e-12)
    assert float(out.policy_loss) == pytest.approx(0.0, abs=1e-12)  # A = 0 on the trained tokens
    metrics = {name: float(total / count) for name, (total, count) in out.metrics.items()}
    # value_loss is reported without the coefficient; 1 of 2 tokens took the clipped branch; mean V (1 + 0)/2
    assert metrics == pytest.approx({"value_loss": 0.41, "value_clip_fraction": 0.5, "value_mean": 0.5}, abs=1e-12)
    out.loss.backward()
    assert values.grad is not None  # 0.5 · (0, V − R = −1) / 2 and nothing for the masked token
    assert values.grad.tolist()[0] == pytest.approx([0.0, -0.25, 0.0], abs=1e-12)
    assert logprobs.grad is not None and float(logprobs.grad[0, 2]) == 0.0


def test_the_entropy_bonus_lowers_the_loss_as_entropy_grows() -> None:
    logprobs = f64([[-1.0, -1.0]])
    entropy = f64([[0.5, 1.0]], grad=True)
    base = ppo_loss(logprobs, **ppo_inputs(logprobs, behaviour_logprobs=f64([[-1.0, -1.0]])))  # type: ignore[arg-type]
    out = ppo_loss(logprobs, **ppo_inputs(logprobs, behaviour_logprobs=f64([[-1.0, -1.0]]),  # type: ignore[arg-type]
                                          entropy=entropy, entropy_coef=0.1))
    # −0.1·(0.5 + 1.0)/2 = −0.075
    assert float(out.loss.detach()) - float(base.loss.detach()) == pytest.approx(-0.075, abs=1e-12)
    out.loss.backward()
    assert entropy.grad is not None
    assert entropy.grad.tolist()[0] == pytest.approx([-0.05, -0.05], abs=1e-12)  # −coef/N: more entropy, less loss
    off = ppo_loss(logprobs, **ppo_inputs(logprobs, behaviour_logprobs=f64([[-1.0, -1.0]]),  # type: ignore[arg-type]
                                          entropy=entropy, entropy_coef=0.0))
    assert float(off.loss.detach()) == pytest.approx(float(base.loss.detach()), abs=1e-12)


def test_the_reported_kl_is_k3_against_the_reference() -> None:
    # π = 0.5, π_ref = 0.25: r = log(π_ref/π) = −log 2; e^r − r − 1 = 0.5 + 0.693147 − 1 = 0.193147
    logprobs = f64([[math.log(0.5)]])
    out = ppo_loss(logprobs, **ppo_inputs(logprobs, behaviour_logprobs=logprobs.clone(),  # type: ignore[arg-type]
                                          ref_logprobs=f64([[math.log(0.25)]])))
    assert float(out.kl) == pytest.approx(0.5 + math.log(2.0) - 1.0, abs=1e-12)
    assert float(ppo_loss(logprobs, **ppo_inputs(logprobs)).kl) == 0.0  # type: ignore[arg-type]


def test_the_objective_routes_the_batch_extras_to_the_loss() -> None:
    objective = build_objective(PPOConfig(value_coef=1.0, clip_ratio=0.2, value_clip=None))
    assert isinstance(objective, PPO) and objective.heads == frozenset({"value"})
    assert not objective.entropy_gradient and build_objective(PPOConfig(entropy_coef=0.01)).entropy_gradient
    logprobs = f64([[-1.0, -2.0]], grad=True)
    values = f64([[0.5, 0.0]], grad=True)
    policy = PolicyBatch(logprobs, torch.tensor([[True, True]]), f64([[-1.0, -2.0]]), torch.zeros(1), values=values,
                         extras={"advantages": f64([[1.0, -1.0]]), "returns": f64([[1.5, 1.0]]),
                                 "old_values": f64([[0.0, 0.0]]), "ref_logprobs": f64([[-1.0, -2.0]])})  # fmt: skip
    sequence = TrainSequence([1, 2, 3], [False, True, True], [0.0, -1.0, -2.0], 0.0)
    assert objective.normalizer([sequence]) == 2.0
    out = objective.loss(policy, objective.normalizer([sequence]))
    # ρ = 1: policy (−1 + 1)/2 = 0; value ½((0.5 − 1.5)² + (0 − 1)²)/2 = 0.5; kl 0 (π = π_ref)
    assert float(out.loss.detach()) == pytest.approx(0.5, abs=1e-12)
    assert float(out.kl) == pytest.approx(0.0, abs=1e-12)


# ---------------------------------------------------------------------------------------- SelectedLogprobs


def entropy_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 5, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(11, 5, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(11, dtype=torch.float64, generator=g, requires_grad=True)
    return hidden, weight, bias, torch.tensor([0, 3, 10, 3, 7, 1])


def plain(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
          targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log_softmax gathered at the targets, and −Σ p·log p: autograd's own gradients."""
    log_probs = F.linear(hidden, weight, bias).log_softmax(-1)
    return log_probs.gather(-1, targets[:, None]).squeeze(-1), -(log_probs.exp() * log_probs).sum(-1)


def test_the_entropy_gradient_matches_autograd() -> None:
    hidden, weight, bias, targets = entropy_case()
    chosen, entropy = SelectedLogprobs.apply(hidden, weight, bias, targets, True)
    expected_chosen, expected_entropy = plain(hidden, weight, bias, targets)
    torch.testing.assert_close(chosen, expected_chosen, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(entropy, expected_entropy, rtol=1e-12, atol=1e-12)
    assert entropy.requires_grad
    g = torch.Generator().manual_seed(1)
    up_chosen = torch.randn(6, dtype=torch.float64, generator=g)
    up_entropy = torch.randn(6, dtype=torch.float64, generator=g)
    inputs = (hidden, weight, bias)
    cases: list[tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], str]] = [
        (lambda lp, h: (up_chosen * lp).sum() + (up_entropy * h).sum(), "both outputs"),
        (lambda lp, h: (up_entropy * h).sum(), "entropy only"),
        (lambda lp, h: (up_chosen * lp).sum(), "logprobs only"),
    ]
    for objective, label in cases:
        ours = torch.autograd.grad(objective(*SelectedLogprobs.apply(hidden, weight, bias, targets, True)), inputs)
        theirs = torch.autograd.grad(objective(*plain(hidden, weight, bias, targets)), inputs)
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=label)
    assert torch.autograd.gradcheck(lambda h, w, b: SelectedLogprobs.apply(h, w, b, targets, True), inputs)


def test_without_the_entropy_gradient_the_entropy_is_constant_and_logprob_gradients_are_unchanged() -> None:
    hidden, weight, bias, targets = entropy_case()
    chosen, entropy = SelectedLogprobs.apply(hidden, weight, bias, targets, False)
    assert not entropy.requires_grad and chosen.requires_grad
    upstream = torch.randn(6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    ours = torch.autograd.grad((upstream * chosen).sum(), (hidden, weight, bias))
    theirs = torch.autograd.grad((upstream * plain(hidden, weight, bias, targets)[0]).sum(), (hidden, weight, bias))
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_the_entropy_gradient_reaches_the_adapter_through_masked_chunks() -> None:
    model = tiny_peft_model()
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.zeros((2, 8), dtype=torch.bool)
    mask[0, 4:] = True
    mask[1, 1:6] = True
    params = [p for p in model.parameters() if p.requires_grad]
    hidden = decoder_states(model, ids)
    _, entropy = logprobs_from_states(model, hidden, ids[:, 1:], mask=mask, chunk_tokens=3, entropy_gradient=True)
    ours = torch.autograd.grad(entropy.sum(), params)
    log_probs = model(input_ids=ids).logits[:, :-1].float().log_softmax(-1)  # [2, 8, V]
    full_entropy = -(log_probs.exp() * log_probs).sum(-1)
    torch.testing.assert_close(entropy[mask], full_entropy[mask].detach(), rtol=1e-5, atol=1e-5)
    assert bool((entropy[~mask] == 0).all())
    theirs = torch.autograd.grad(full_entropy[mask].sum(), params)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------- PPO.prepare

# Three sequences, target-aligned entries j (token j + 1); 9.0 marks entries that are not trainable, which
# prepare must ignore (real passes hold 0 there).
PREPARE_SEQUENCES = [
    TrainSequence([1, 2, 3, 4, 5], [False, False, True, True, True], [0.0] * 5, 0.0, reward=1.0),  # j = 1, 2, 3
    TrainSequence([1, 2, 3, 4], [False, True, False, True], [0.0] * 4, 0.0, reward=-1.0),  # j = 0, 2
    TrainSequence([1, 2, 3], [True, False, False], [0.0] * 3, 0.0, reward=5.0),  # nothing trainable
]
REFERENCE = [f32([9.0, -1.0, -1.0, -2.0]), f32([-1.0, 9.0, -1.0]), f32([9.0, 9.0])]
OLD_LOGPROBS = [f32([9.0, -0.5, -1.0, -1.5]), f32([-1.2, 9.0, -0.8]), f32([9.0, 9.0])]
OLD_VALUES = [f32([9.0, 0.1, 0.2, 0.3]), f32([0.5, 9.0, -0.5]), f32([9.0, 9.0])]
MODEL_SCORES = [0.5, 0.0, 0.0]
# kl = logπ_old − logπ_ref: sequence 0 (0.5, 0, 0.5), sequence 1 (−0.2, 0.2); mean over the 5 tokens 0.2.
# With β = 0.1 (carried in the state) and score = reward + the reward model's:
#   sequence 0: score 1.5, rewards (−0.05, 0, −0.05 + 1.5) = (−0.05, 0, 1.45); γ = λ = 1: returns are the sums
#     of what is left (1.4, 1.45, 1.45), advantages returns − V = (1.3, 1.25, 1.15)
#   sequence 1: score −1, rewards (0.02, −0.02 − 1) = (0.02, −1.02); returns (−1.0, −1.02), advantages (−1.5, −0.52)
ADVANTAGES = [[0.0, 1.3, 1.25, 1.15], [-1.5, 0.0, -0.52], [0.0, 0.0]]
RETURNS = [[0.0, 1.4, 1.45, 1.45], [-1.0, 0.0, -1.02], [0.0, 0.0]]


def passes(state: dict[str, float], scores: list[float] | None = MODEL_SCORES) -> JobPasses:
    return JobPasses(sequences=PREPARE_SEQUENCES, state=state, reference_logprobs=lambda: REFERENCE,
                     policy_outputs=lambda: (OLD_LOGPROBS, OLD_VALUES),
                     reward_scores=None if scores is None else (lambda: scores))  # fmt: skip


def test_prepare_computes_gae_on_the_kl_shaped_rewards_of_the_sampled_tokens() -> None:
    objective = PPO(PPOConfig(gamma=1.0, lam=1.0, whiten_advantages=False, kl_penalty_coef=0.05, kl_target=0.01,
                              kl_horizon=10))  # fmt: skip
    prepared = objective.prepare(passes({KL_COEF_STATE: 0.1}))
    for got, expected in zip(prepared.extras["advantages"], ADVANTAGES, strict=True):
        assert got.tolist() == pytest.approx(expected, abs=1e-6)
    for got, expected in zip(prepared.extras["returns"], RETURNS, strict=True):
        assert got.tolist() == pytest.approx(expected, abs=1e-6)
    assert prepared.extras["old_values"] is OLD_VALUES and prepared.extras["ref_logprobs"] is REFERENCE
    # KL 0.2 is 20× the target: error +0.2, 2 sequences over a horizon of 10: 0.1·(1 + 0.2·2/10) = 0.104
    assert prepared.state == pytest.approx({KL_COEF_STATE: 0.104}, abs=1e-12)
    values = [0.1, 0.2, 0.3, 0.5, -0.5]
    returns = [1.4, 1.45, 1.45, -1.0, -1.02]
    residual = statistics.pvariance([r - v for r, v in zip(returns, values, strict=True)])
    assert prepared.metrics == pytest.approx({
        "score_mean": 0.25,  # (1.5 − 1)/2: the third sequence has nothing to train
        "reward_mean": 0.2,  # (1.4 − 1.0)/2: sums of the shaped rewards
        "kl_old_ref": 0.2,
        "kl_coef": 0.1,
        "next_kl_coef": 0.104,
        "explained_variance": 1.0 - residual / statistics.pvariance(returns),
    }, abs=1e-6)


def test_prepare_whitens_the_advantages_of_the_sampled_tokens_only() -> None:
    objective = PPO(PPOConfig(gamma=1.0, lam=1.0, whiten_advantages=True))
    prepared = objective.prepare(passes({KL_COEF_STATE: 0.1}))
    raw = [1.3, 1.25, 1.15, -1.5, -0.52]
    mean, std = statistics.fmean(raw), statistics.pstdev(raw)
    expected = [(x - mean) / std for x in raw]
    got = prepared.extras["advantages"]
    assert [float(got[0][j]) for j in (1, 2, 3)] + [float(got[1][j]) for j in (0, 2)] == \
        pytest.approx(expected, abs=1e-5)
    assert float(got[0][0]) == 0.0 and float(got[1][1]) == 0.0 and got[2].tolist() == [0.0, 0.0]
    for returned, expected_returns in zip(prepared.extras["returns"], RETURNS, strict=True):  # not whitened
        assert returned.tolist() == pytest.approx(expected_returns, abs=1e-6)


def test_prepare_starts_from_the_configured_coefficient_and_can_keep_it_fixed() -> None:
    fresh = PPO(PPOConfig(gamma=1.0, lam=1.0, kl_penalty_coef=0.05, kl_target=1.0, kl_horizon=10))
    prepared = fresh.prepare(passes({}, scores=None))
    # β = 0.05, no reward model: sequence 0's rewards (−0.025, 0, −0.025 + 1), score_mean (1 − 1)/2 = 0
    assert prepared.metrics["kl_coef"] == 0.05 and prepared.metrics["score_mean"] == pytest.approx(0.0, abs=1e-12)
    assert prepared.metrics["reward_mean"] == pytest.approx((0.95 - 1.0) / 2, abs=1e-6)  # 1 − 0.05·1, −1 − 0
    # KL 0.2 below the target 1.0: error −0.8 clipped to −0.2: 0.05·(1 − 0.2·2/10) = 0.048
    assert prepared.state == pytest.approx({KL_COEF_STATE: 0.048}, abs=1e-12)
    fixed = PPO(PPOConfig(kl_penalty_coef=0.05, adaptive_kl=False)).prepare(passes({KL_COEF_STATE: 0.3}))
    assert fixed.state == {KL_COEF_STATE: 0.3} and fixed.metrics["next_kl_coef"] == 0.3


# ---------------------------------------------------------------------------------------- the loop


def ppo_batch() -> list[TrainSequence]:
    sequences = batch()
    for index, sequence in enumerate(sequences):
        sequence.reward = float(index) - 2.0  # −2 … 2
    return sequences


def train_ppo(config: PPOConfig, sequences: list[TrainSequence], *, state: dict[str, float] | None = None,
              sgd: bool = False, reward_scores: Callable[[], list[float]] | None = None,
              ) -> tuple[torch.nn.Module, ValueHead, list[StepEvent], dict[str, float], list[torch.Tensor]]:
    model = tiny_peft_model()
    value_head = ValueHead(32)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=config.learning_rate) if sgd else torch.optim.AdamW(params)
    optimizer.add_param_group({"params": list(value_head.parameters())})
    events: list[StepEvent] = []
    result = run_optimizer_steps(model, optimizer, sequences, config, pad_token_id=0, on_step=events.append,
                                 reference=model.disable_adapter, heads={"value": value_head}, state=state,
                                 reward_scores=reward_scores)  # fmt: skip
    assert result.events == events
    after = [p.detach().clone() for p in params] + [p.detach().clone() for p in value_head.parameters()]
    return model, value_head, events, result.state, after


def test_a_ppo_job_trains_the_value_head_and_carries_the_kl_coefficient() -> None:
    sequences = ppo_batch()
    validate_batch(sequences, VOCAB)
    # The job's KL(π_old ‖ π_ref), measured here independently: full log-softmax with and without the adapter.
    probe = tiny_peft_model()
    probe.eval()
    kls = []
    with torch.no_grad():
        for s in sequences:
            ids = torch.tensor([s.token_ids])
            policy = reference_logprobs(probe, ids)[0]
            with probe.disable_adapter():
                base = reference_logprobs(probe, ids)[0]
            trained = torch.tensor(s.trainable[1:])
            kls.append((policy - base)[trained])
    kl = float(torch.cat(kls).mean())
    assert 1e-4 < abs(kl) < 0.008  # the adapter is not zero, and the KL is well below the 0.01 target

    config = PPOConfig(epochs=2, gradient_steps_per_epoch=1, learning_rate=1e-3, kl_penalty_coef=0.05,
                       kl_target=0.01, kl_horizon=100)  # fmt: skip
    _, value_head, events, state, _ = train_ppo(config, sequences, state={KL_COEF_STATE: 0.2, "other": 1.0},
                                                reward_scores=lambda: [0.1 * i for i in range(5)])  # fmt: skip
    assert [e.objective for e in events] == ["ppo", "ppo"]
    first, second = events[0].metrics, events[1].metrics
    assert {"value_loss", "value_clip_fraction", "value_mean", "score_mean", "reward_mean", "kl_old_ref", "kl_coef",
            "next_kl_coef", "explained_variance"} <= set(first)  # fmt: skip
    assert first["kl_coef"] == 0.2  # carried in, not the configured 0.05
    assert first["kl_old_ref"] == pytest.approx(kl, abs=2e-6)
    # rewards −2 … 2 (mean 0) plus the reward model's 0, 0.1 … 0.4 (mean 0.2)
    assert first["score_mean"] == pytest.approx(0.2, abs=1e-6)
    # KL below target: error clipped to −0.2, 5 sequences over a horizon of 100: 0.2·(1 − 0.2·5/100) = 0.198
    assert state == pytest.approx({KL_COEF_STATE: 0.198, "other": 1.0}, abs=1e-12)
    assert first["next_kl_coef"] == pytest.approx(state[KL_COEF_STATE], abs=1e-12)
    # the value head starts at 0: the first step sees V = 0, which explains none of the returns' variance
    assert first["value_mean"] == pytest.approx(0.0, abs=1e-7)
    assert first["explained_variance"] == pytest.approx(0.0, abs=1e-6)
    assert first["value_loss"] > 0 and all(math.isfinite(e.loss) and e.grad_norm > 0 for e in events)
    # the job's statistics are in every step; the value head has moved by the second
    assert second["kl_old_ref"] == first["kl_old_ref"] and second["value_mean"] != 0.0
    assert float(value_head.linear.weight.detach().abs().sum()) > 0


def test_the_entropy_bonus_alone_raises_the_entropy() -> None:
    """Rewards 0, β 0 and a zero value head: every advantage, return and value is 0, so the policy and value
    losses and their gradients are exactly 0. What is left of a step is −entropy_coef·Σ H / N."""
    runs = {}
    for coef in (0.0, 10.0):  # a tiny random model is near-uniform (H ≈ log 97): a strong bonus to see it move
        sequences = ppo_batch()
        for sequence in sequences:
            sequence.reward = 0.0
        config = PPOConfig(epochs=2, gradient_steps_per_epoch=1, learning_rate=1.0, entropy_coef=coef,
                           kl_penalty_coef=0.0, max_grad_norm=None, micro_batch_tokens=128)  # fmt: skip
        runs[coef] = train_ppo(config, sequences, sgd=True)[2]
    plain, bonus = runs[0.0], runs[10.0]
    assert [e.loss for e in plain] == [0.0, 0.0] and [e.grad_norm for e in plain] == [0.0, 0.0]
    assert plain[1].entropy == pytest.approx(plain[0].entropy, rel=1e-6)  # nothing moved
    assert bonus[0].entropy == pytest.approx(plain[0].entropy, rel=1e-6)  # the same weights at step 1
    assert bonus[0].loss == pytest.approx(-10.0 * bonus[0].entropy, rel=1e-5)  # −10 × the mean entropy
    assert bonus[0].grad_norm > 0
    assert bonus[1].entropy - bonus[0].entropy > 5e-5  # gradient descent on −H raised H


def test_shared_prompts_and_micro_batches_do_not_change_a_ppo_step() -> None:
    """Sequences sharing a 70-token prompt: the prepare passes and the step run it once per micro-batch (the
    advantages and old values are collated after the prefix), with the same result as whole sequences."""
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(3, VOCAB, (70,), generator=g).tolist()
    sequences = []
    for index in range(4):
        answer = torch.randint(3, VOCAB, (6 + 3 * index,), generator=g).tolist()
        ids = prompt + answer
        trainable = [i >= len(prompt) for i in range(len(ids))]
        logprobs = [-3.0 - 0.1 * i if t else 0.0 for i, t in enumerate(trainable)]
        sequences.append(TrainSequence(ids, trainable, logprobs, 0.0, reward=float(index % 2)))
    results = []
    for share, tokens in ((False, 4096), (True, 4096), (False, 128)):
        config = PPOConfig(epochs=1, gradient_steps_per_epoch=1, learning_rate=1e-2, share_prefixes=share,
                           micro_batch_tokens=tokens, max_grad_norm=None, entropy_coef=0.01)  # fmt: skip
        _, _, events, state, params = train_ppo(config, copy.deepcopy(sequences), sgd=True)
        results.append((events[0], state, params))
    whole, whole_state, whole_params = results[0]
    # float32 sums in another order (shared prefixes, micro-batches) differ by a few ulps: the loss here is
    # ~178, so the tolerance is relative (1e-6, ~8 ulps) as well as absolute for the values near 0
    for event, state, params in results[1:]:
        assert event.loss == pytest.approx(whole.loss, rel=1e-6, abs=1e-5)
        assert event.metrics == pytest.approx(whole.metrics, rel=1e-6, abs=1e-5)
        assert state == pytest.approx(whole_state, rel=1e-5)
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(whole_params, params, strict=True))
    assert results[1][0].decoder_positions < whole.decoder_positions  # the prompt ran once


def test_a_ppo_job_without_its_value_head_is_refused() -> None:
    model = tiny_peft_model()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    with pytest.raises(ValueError, match="value"):
        run_optimizer_steps(model, optimizer, ppo_batch(), PPOConfig(epochs=1), pad_token_id=0,
                            on_step=lambda e: None, reference=model.disable_adapter)  # fmt: skip
