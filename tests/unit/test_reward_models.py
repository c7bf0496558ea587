"""Reward models on the objective seam: the Bradley–Terry and masked-regression losses on hand-computed scores
(reward_model.py's docstring), the reward head (heads.py), the loop training a head on a synthetic preference,
`score_sequences`, the adapter directory of a reward model (and of a PPO policy's value head), and the batch
file's rewards and targets."""

from __future__ import annotations

import copy
import doctest
import math
from pathlib import Path

import orjson
import pytest
import torch
from artlike_server.torch_worker import heads
from artlike_server.torch_worker.adapters import (
    CONFIG_FILE,
    STATE_FILE,
    WEIGHTS_FILE,
    AdapterSlots,
    peft_lora_config,
    read_state,
)
from artlike_server.torch_worker.heads import (
    REWARD_HEAD_FILE,
    SCORE_KEY,
    VALUE_HEAD_FILE,
    RewardHead,
    ValueHead,
    pool,
)
from artlike_server.torch_worker.logprobs import decoder_states
from artlike_server.torch_worker.loop import collate, run_optimizer_steps, score_sequences, validate_batch
from artlike_server.torch_worker.objectives import PolicyBatch, build_objective, reward_model
from artlike_server.torch_worker.objectives.reward_model import (
    RewardModel,
    bradley_terry_losses,
    masked_squared_errors,
    reward_model_loss,
)
from artlike_server.trainer_ipc.batch_file import read_batch, write_batch
from artlike_server.trainer_ipc.sequences import TrainSequence
from peft import PeftModel
from safetensors.torch import load_file
from transformers import LlamaForSequenceClassification

from artlike.types import LoraConfig, RewardHeadConfig, RewardModelConfig, StepEvent

from .test_training_loop import VOCAB, tiny_peft_model
from .test_training_session_worker import tiny_base

NAN = math.nan


def softplus(x: float) -> float:
    """−log σ(−x) = log(1 + eˣ): the Bradley–Terry loss of a pair whose gap is −x."""
    return math.log1p(math.exp(x))


def mean_metrics(metrics: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
    """Each metric's mean (sum / count); those with a zero count are left out."""
    return {name: float(total / count) for name, (total, count) in metrics.items() if float(count)}


def test_doctests() -> None:
    for module in (reward_model, heads):
        assert doctest.testmod(module).failed == 0


# ---------------------------------------------------------------------------------------- pure losses


@pytest.mark.parametrize(("chosen", "rejected", "margin", "smoothing", "expected"), [
    (2.0, 0.0, 0.0, 0.0, softplus(-2.0)),  # −log σ(2) = log(1 + e⁻²) = 0.126928
    (0.0, 1.0, 0.0, 0.0, softplus(1.0)),  # the wrong order: −log σ(−1) = log(1 + e) = 1.313262
    (2.0, 0.0, 1.0, 0.0, softplus(-1.0)),  # the margin eats 1 of the gap: −log σ(1) = 0.313262
    (0.5, 0.0, 1.0, 0.0, softplus(0.5)),  # a gap below the margin counts as the wrong order: −log σ(−0.5)
    # ε = 0.1 of the labels assumed flipped: 0.9·(−log σ(2)) + 0.1·(−log σ(−2)) = 0.9·0.126928 + 0.1·2.126928
    (2.0, 0.0, 0.0, 0.1, 0.9 * softplus(-2.0) + 0.1 * softplus(2.0)),
    # both: gap 3 − 1 = 2, then 0.8·0.126928 + 0.2·2.126928 = 0.526928
    (3.0, 0.0, 1.0, 0.2, 0.8 * softplus(-2.0) + 0.2 * softplus(2.0)),
])
def test_bradley_terry_worked_pairs(chosen: float, rejected: float, margin: float, smoothing: float,
                                    expected: float) -> None:
    got = bradley_terry_losses(torch.tensor([chosen], dtype=torch.float64), torch.tensor([rejected], dtype=torch.float64),
                               margin=margin, label_smoothing=smoothing)  # fmt: skip
    assert got.shape == (1,)
    assert float(got[0]) == pytest.approx(expected, abs=1e-12)


def test_label_smoothing_makes_a_confident_pair_cost_more_than_the_smoothed_minimum() -> None:
    # With ε > 0 the loss is no longer minimised at an infinite gap: at gap 10 it is ≈ ε·10 = 1.0.
    gaps = torch.tensor([10.0], dtype=torch.float64)
    assert float(bradley_terry_losses(gaps, torch.zeros(1, dtype=torch.float64), label_smoothing=0.1)[0]) == \
        pytest.approx(0.9 * softplus(-10.0) + 0.1 * softplus(10.0), abs=1e-12)  # 0.9·4.5e-5 + 0.1·10.000045
    assert float(bradley_terry_losses(gaps, torch.zeros(1, dtype=torch.float64))[0]) < 1e-4


def test_masked_squared_errors_skip_unknown_targets_in_value_and_gradient() -> None:
    scores = torch.tensor([[1.0, 2.0], [3.0, 4.0], [0.0, 1.0]], dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([[0.0, NAN], [1.0, 5.0], [NAN, NAN]], dtype=torch.float64)
    squared, known = masked_squared_errors(scores, targets)
    # objective 0: (1 − 0)² + (3 − 1)² = 5 over 2 known; objective 1: (4 − 5)² = 1 over 1 known
    assert squared.tolist() == pytest.approx([5.0, 1.0], abs=1e-12)
    assert known.tolist() == [2.0, 1.0]
    squared.sum().backward()
    assert scores.grad is not None
    # d/ds (s − y)² = 2(s − y) where known; 0 (not NaN) where the target is unknown
    assert scores.grad.tolist() == [[2.0, 0.0], [4.0, -2.0], [0.0, 0.0]]


def test_pairs_only_loss_metrics_and_normaliser() -> None:
    # Two pairs of one objective: (1.0 over 0.0) gap +1, and (−0.5 over 0.5) gap −1.
    scores = torch.tensor([[1.0], [0.0], [-0.5], [0.5]], dtype=torch.float64)
    pairs = torch.tensor([[0, 1], [2, 3]])
    out = reward_model_loss(scores, weights=[1.0], pairs=pairs, targets=None, normalizer=2.0)
    # (log(1 + e⁻¹) + log(1 + e¹)) / 2 = (0.313262 + 1.313262) / 2 = 0.813262
    expected = (softplus(-1.0) + softplus(1.0)) / 2
    assert float(out.loss.detach()) == pytest.approx(expected, abs=1e-12)
    assert float(out.policy_loss) == pytest.approx(expected, abs=1e-12)
    metrics = mean_metrics(out.metrics)
    assert metrics == pytest.approx({"bt_loss": expected, "accuracy": 0.5, "margin": 0.0}, abs=1e-12)
    assert float(out.tokens) == 4.0  # the rows (sequences) of the micro-batch
    # the step's normaliser, not the micro-batch's: half of a 4-pair step weighs half
    half = reward_model_loss(scores, weights=[1.0], pairs=pairs, targets=None, normalizer=4.0)
    assert float(half.loss.detach()) == pytest.approx(expected / 2, abs=1e-12)


def test_pairs_train_the_weighted_combination_of_the_objectives() -> None:
    # weights (0.75, 0.25): chosen (1, 3) → 0.75 + 0.75 = 1.5; rejected (2, −2) → 1.5 − 0.5 = 1.0; gap 0.5
    scores = torch.tensor([[1.0, 3.0], [2.0, -2.0]], dtype=torch.float64, requires_grad=True)
    out = reward_model_loss(scores, weights=[0.75, 0.25], pairs=torch.tensor([[0, 1]]), targets=None, normalizer=1.0)
    assert float(out.loss.detach()) == pytest.approx(softplus(-0.5), abs=1e-12)  # log(1 + e^−0.5) = 0.474077
    assert mean_metrics(out.metrics)["margin"] == pytest.approx(0.5, abs=1e-12)
    out.loss.backward()
    # ∂/∂gap = −σ(−0.5) = −0.377541; chosen's objectives get it times their weights, rejected's the opposite
    g = 1.0 / (1.0 + math.exp(0.5))
    assert scores.grad is not None
    assert scores.grad.tolist() == [pytest.approx([-0.75 * g, -0.25 * g], abs=1e-12),
                                    pytest.approx([0.75 * g, 0.25 * g], abs=1e-12)]


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_the_gradient_pushes_chosen_up_and_rejected_down(smoothing: float) -> None:
    # At gap 0: ∂loss/∂gap = −(1 − ε)·σ(0) + ε·σ(0) = −(1 − 2ε)/2, i.e. −0.5 (ε = 0) or −0.3 (ε = 0.2)
    scores = torch.zeros((2, 1), dtype=torch.float64, requires_grad=True)
    out = reward_model_loss(scores, weights=[1.0], pairs=torch.tensor([[1, 0]]), targets=None, normalizer=1.0,
                            label_smoothing=smoothing)  # fmt: skip
    out.loss.backward()
    assert scores.grad is not None
    slope = (1 - 2 * smoothing) / 2
    assert scores.grad.flatten().tolist() == pytest.approx([slope, -slope], abs=1e-12)  # row 1 is the chosen one
    # one gradient-descent step on the scores widens the gap: the loss goes down
    with torch.no_grad():
        stepped = scores - 0.5 * scores.grad
    assert float(stepped[1, 0]) > 0 > float(stepped[0, 0])
    after = reward_model_loss(stepped, weights=[1.0], pairs=torch.tensor([[1, 0]]), targets=None, normalizer=1.0,
                              label_smoothing=smoothing)  # fmt: skip
    assert float(after.loss.detach()) < float(out.loss.detach())


def test_targets_only_regress_every_known_target_with_the_same_weight() -> None:
    scores = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([[0.0, NAN], [1.0, 5.0]], dtype=torch.float64)
    out = reward_model_loss(scores, weights=[0.5, 0.5], pairs=None, targets=targets, normalizer=3.0,
                            regression_weight=0.5, objective_names=["helpful", "harmless"])  # fmt: skip
    # squared errors 1, 4 (helpful) and 1 (harmless): 0.5 · (1 + 4 + 1) / 3 known = 1.0
    assert float(out.loss.detach()) == pytest.approx(1.0, abs=1e-12)
    # metrics are the unweighted mean squared errors: all 6 / 3 = 2, helpful 5 / 2, harmless 1 / 1
    assert mean_metrics(out.metrics) == pytest.approx({"mse": 2.0, "mse_helpful": 2.5, "mse_harmless": 1.0}, abs=1e-12)
    out.loss.backward()
    assert scores.grad is not None  # 0.5 · 2(s − y) / 3
    assert scores.grad.tolist() == [pytest.approx([1 / 3, 0.0], abs=1e-12), pytest.approx([2 / 3, -1 / 3], abs=1e-12)]


def test_rows_without_targets_and_no_pairs_give_a_zero_loss_and_no_metrics() -> None:
    scores = torch.tensor([[1.0], [2.0]], dtype=torch.float64, requires_grad=True)
    out = reward_model_loss(scores, weights=[1.0], pairs=torch.zeros((0, 2), dtype=torch.long),
                            targets=torch.full((2, 1), NAN, dtype=torch.float64), normalizer=0.0)  # fmt: skip
    assert float(out.loss.detach()) == 0.0 and out.metrics == {}


def test_mixed_pairs_and_targets_share_one_normaliser() -> None:
    # rows 0/1: a pair (its rows have no targets); row 2: a scored example with one of two targets known
    sequences = [
        TrainSequence([1, 2, 3], [False, True, True], [0.0] * 3, 0.0, group_index=0, preference=1),
        TrainSequence([1, 2, 4], [False, True, True], [0.0] * 3, 0.0, group_index=0, preference=-1),
        TrainSequence([1, 5, 6], [False, True, True], [0.0] * 3, 0.0, group_index=1, targets=[1.0, NAN]),
    ]
    objective = build_objective(RewardModelConfig(), reward_head=RewardHeadConfig(num_objectives=2))
    assert isinstance(objective, RewardModel)
    normalizer = objective.normalizer(sequences)
    assert normalizer == 2  # 1 pair + 1 known target
    collated = collate(sequences, pad_token_id=0)
    assert collated.pairs is not None and collated.pairs.tolist() == [[0, 1]]
    targets = collated.extras["targets"]
    assert targets.shape == (3, 2) and bool(targets[:2].isnan().all())
    assert float(targets[2, 0]) == 1.0 and math.isnan(float(targets[2, 1]))
    # equal weights (0.5, 0.5): chosen (1, 1) → 1, rejected (0, 0) → 0, gap 1; row 2 scores 2 for target 1
    scores = torch.tensor([[1.0, 1.0], [0.0, 0.0], [2.0, 0.0]], requires_grad=True)
    batch = PolicyBatch(torch.zeros(3, 2), collated.mask, collated.behaviour_logprobs, collated.advantages,
                        pairs=collated.pairs, scores=scores, extras=collated.extras)  # fmt: skip
    out = objective.loss(batch, normalizer)
    # (log(1 + e⁻¹) + (2 − 1)²) / 2 = (0.313262 + 1) / 2 = 0.656631
    assert float(out.loss.detach()) == pytest.approx((softplus(-1.0) + 1.0) / 2, abs=1e-6)
    assert mean_metrics(out.metrics) == pytest.approx(
        {"bt_loss": softplus(-1.0), "accuracy": 1.0, "margin": 1.0, "mse": 1.0, "mse_o0": 1.0}, abs=1e-6)
    # objective o1 has no known target in the batch: no metric (a mean of nothing is not an error of 0)
    assert "mse_o1" not in out.metrics


def test_center_rewards_coefficient_penalises_the_pair_sum() -> None:
    pairs = torch.tensor([[0, 1]])
    # off-centre pair (1, 0): + 0.01 · (1 + 0)² = 0.01
    off = reward_model_loss(torch.tensor([[1.0], [0.0]], dtype=torch.float64), weights=[1.0], pairs=pairs,
                            targets=None, normalizer=1.0, center_rewards_coefficient=0.01)  # fmt: skip
    assert float(off.loss.detach()) == pytest.approx(softplus(-1.0) + 0.01, abs=1e-12)
    # centred pair (1, −1): (1 − 1)² = 0, only the BT loss of gap 2 is left
    centred = reward_model_loss(torch.tensor([[1.0], [-1.0]], dtype=torch.float64), weights=[1.0], pairs=pairs,
                                targets=None, normalizer=1.0, center_rewards_coefficient=0.01)  # fmt: skip
    assert float(centred.loss.detach()) == pytest.approx(softplus(-2.0), abs=1e-12)
    # its gradient on both scores: 2 · 0.01 · (s_c + s_r) = 0.02 at the off-centre pair, on top of BT's ∓σ(−1)
    scores = torch.tensor([[1.0], [0.0]], dtype=torch.float64, requires_grad=True)
    reward_model_loss(scores, weights=[1.0], pairs=pairs, targets=None, normalizer=1.0,
                      center_rewards_coefficient=0.01).loss.backward()  # fmt: skip
    s = 1.0 / (1.0 + math.e)  # σ(−1) = 0.268941
    assert scores.grad is not None
    assert scores.grad.flatten().tolist() == pytest.approx([-s + 0.02, s + 0.02], abs=1e-12)


def test_the_objective_asks_for_the_reward_head_and_no_logprobs() -> None:
    last = build_objective(RewardModelConfig(), reward_head=RewardHeadConfig())
    mean = build_objective(RewardModelConfig(), reward_head=RewardHeadConfig(pooling="mean"))
    assert last.heads == frozenset({"reward"}) and not last.needs_logprobs and not last.needs_reference
    assert last.shares_prefixes and not mean.shares_prefixes  # a mean needs every token's state in the row


# ---------------------------------------------------------------------------------------- heads


def test_pool_last_and_mean_ignore_right_padding() -> None:
    # row 0 has 3 tokens, row 1 has 1 (then two pads holding 100s that must not count)
    hidden = torch.tensor([
        [[1.0, 2.0], [3.0, 4.0], [5.0, 9.0]],
        [[2.0, -2.0], [100.0, 100.0], [100.0, 100.0]],
    ])  # fmt: skip
    lengths = torch.tensor([3, 1])
    assert pool(hidden, lengths, "last").tolist() == [[5.0, 9.0], [2.0, -2.0]]
    # mean of row 0: ((1 + 3 + 5)/3, (2 + 4 + 9)/3) = (3, 5); row 1: its only token
    assert pool(hidden, lengths, "mean").tolist() == [[3.0, 5.0], [2.0, -2.0]]


def test_reward_head_scores_are_w_times_the_pooled_state_and_combine_with_the_weights() -> None:
    config = RewardHeadConfig(num_objectives=2, objective_weights=[0.25, 0.75], pooling="last")
    head = RewardHead(2, config)
    with torch.no_grad():
        head.score.weight.copy_(torch.tensor([[1.0, 0.0], [1.0, -1.0]]))
    hidden = torch.tensor([[[9.0, 9.0], [4.0, 1.0]], [[2.0, 8.0], [0.0, 0.0]]], dtype=torch.bfloat16)
    scores = head(hidden, torch.tensor([2, 1]))
    assert scores.dtype == torch.float32  # computed in float32 from a bf16 decoder
    # row 0 pools (4, 1): (4, 4 − 1) = (4, 3); row 1 pools (2, 8): (2, 2 − 8) = (2, −6)
    assert scores.tolist() == [[4.0, 3.0], [2.0, -6.0]]
    # 0.25·4 + 0.75·3 = 3.25; 0.25·2 + 0.75·(−6) = −4.0
    assert head.combined(scores).tolist() == pytest.approx([3.25, -4.0], abs=1e-6)
    # the default weights are equal and sum to 1: (4 + 3)/2
    assert RewardHead(2, RewardHeadConfig(num_objectives=2)).combined(scores).tolist()[0] == pytest.approx(3.5)


def test_reward_head_initialisation_is_small_and_seeded() -> None:
    config = RewardHeadConfig(num_objectives=3)
    a, b, c = RewardHead(64, config, seed=1), RewardHead(64, config, seed=1), RewardHead(64, config, seed=2)
    assert a.score.weight.shape == (3, 64) and a.score.bias is None  # HF's `score`: no bias
    assert torch.equal(a.score.weight, b.score.weight) and not torch.equal(a.score.weight, c.score.weight)
    assert float(a.score.weight.detach().std()) == pytest.approx(0.02, rel=0.3)  # 192 draws of N(0, 0.02²)


def test_value_head_starts_at_zero_everywhere_and_can_learn() -> None:
    head = ValueHead(8)
    hidden = torch.randn(2, 5, 8, dtype=torch.bfloat16)
    values = head(hidden)
    assert values.shape == (2, 5) and values.dtype == torch.float32
    assert bool((values == 0).all())
    values.sum().backward()
    assert head.linear.bias.grad is not None and float(head.linear.bias.grad) == 10.0  # ∂Σv/∂b = 10 positions
    assert head.linear.weight.grad is not None
    assert torch.allclose(head.linear.weight.grad[0], hidden.float().sum(dim=(0, 1)), atol=1e-5)


def test_heads_load_none_from_a_directory_without_them(tmp_path: Path) -> None:
    assert ValueHead.load(tmp_path, 8, torch.device("cpu")) is None
    assert RewardHead.load(tmp_path, {SCORE_KEY: torch.zeros(1, 8)}, 8, torch.device("cpu")) is None  # no json
    RewardHead(8, RewardHeadConfig()).save_config(tmp_path)
    assert RewardHead.load(tmp_path, {}, 8, torch.device("cpu")) is None  # no score weight
    with pytest.raises(ValueError, match="score head"):
        RewardHead.load(tmp_path, {SCORE_KEY: torch.zeros(2, 8)}, 8, torch.device("cpu"))


# ---------------------------------------------------------------------------------------- the loop

MARK = 7  # the token the synthetic preference is about: a chosen answer ends with it


def preference_pairs(seed: int, count: int, prompt_length: int = 6, first_group: int = 0) -> list[TrainSequence]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(count):
        prompt = torch.randint(10, VOCAB, (prompt_length,), generator=g).tolist()
        chosen = prompt + torch.randint(10, VOCAB, (3,), generator=g).tolist() + [MARK]
        rejected = prompt + torch.randint(10, VOCAB, (4,), generator=g).tolist()
        for ids, side in ((chosen, 1), (rejected, -1)):
            out.append(TrainSequence(ids, [i >= prompt_length for i in range(len(ids))], [0.0] * len(ids), 0.0,
                                     group_index=first_group + k, preference=side))  # fmt: skip
    return out


def scored_examples(seed: int, count: int, first_group: int) -> list[TrainSequence]:
    """Examples with targets: +1 for an answer ending in MARK, −1 otherwise, on objective 0 only."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(count):
        ids = torch.randint(10, VOCAB, (8 + k % 3,), generator=g).tolist()
        if k % 2 == 0:
            ids[-1] = MARK
        out.append(TrainSequence(ids, [i >= 4 for i in range(len(ids))], [0.0] * len(ids), 0.0,
                                 group_index=first_group + k, targets=[1.0 if k % 2 == 0 else -1.0, NAN]))  # fmt: skip
    return out


def train_reward_model(sequences: list[TrainSequence], config: RewardModelConfig, head_config: RewardHeadConfig,
                       *, sgd: bool = False) -> tuple[list[StepEvent], torch.nn.Module, RewardHead, list[torch.Tensor]]:
    model = tiny_peft_model()
    head = RewardHead(32, head_config, seed=3)
    params = [p for p in model.parameters() if p.requires_grad] + list(head.parameters())
    optimizer = torch.optim.SGD(params, lr=config.learning_rate) if sgd else torch.optim.AdamW(params)
    events: list[StepEvent] = []
    run_optimizer_steps(model, optimizer, sequences, config, pad_token_id=0, on_step=events.append,
                        heads={"reward": head}, objective=build_objective(config, reward_head=head_config))  # fmt: skip
    return events, model, head, [p.detach().clone() for p in params]


def test_bradley_terry_training_learns_a_synthetic_preference() -> None:
    config = RewardModelConfig(learning_rate=0.02, epochs=6, max_grad_norm=None)
    sequences = preference_pairs(0, 8)
    events, model, head, _ = train_reward_model(sequences, config, RewardHeadConfig())
    assert [e.objective for e in events] == ["reward_model"] * 6
    assert events[-1].metrics["accuracy"] == 1.0
    assert events[-1].loss < 0.25 * events[0].loss  # from ≈ log 2 at the small initial head
    assert events[0].loss == pytest.approx(math.log(2), abs=0.1)
    assert events[-1].metrics["margin"] > events[0].metrics["margin"] + 1.0
    # a step's tokens are its answers' trainable tokens: 16 sequences × 4
    assert all(e.tokens == sum(s.num_trainable_tokens for s in sequences) == 64 for e in events)
    # held-out pairs of the same rule are ordered too
    model.eval()
    held_out = preference_pairs(1, 8)
    scores = score_sequences(model, [s.token_ids for s in held_out], head, pad_token_id=0, token_budget=4096)
    chosen, rejected = scores[0::2, 0], scores[1::2, 0]
    assert bool((chosen > rejected).all())


def test_scored_examples_train_each_objective_toward_its_targets() -> None:
    config = RewardModelConfig(learning_rate=0.02, epochs=6, max_grad_norm=None)
    head_config = RewardHeadConfig(num_objectives=2, objective_names=["mark", "unused"])
    sequences = preference_pairs(0, 4) + scored_examples(5, 6, first_group=4)
    events, *_ = train_reward_model(sequences, config, head_config)
    first, last = events[0].metrics, events[-1].metrics
    # no target of objective "unused" anywhere: it gets no metric rather than a perfect-looking 0
    assert set(first) == {"bt_loss", "accuracy", "margin", "mse", "mse_mark"}
    assert first["mse"] == pytest.approx(first["mse_mark"], rel=1e-6)  # every known target is "mark"'s
    assert first["mse_mark"] == pytest.approx(1.0, abs=0.15)  # scores start near 0, targets are ±1
    assert last["mse_mark"] < 0.5 * first["mse_mark"]
    assert last["accuracy"] == 1.0


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_micro_batching_and_shared_prompts_do_not_change_the_update(pooling: str) -> None:
    """One SGD step: the step's normaliser (pairs + known targets of all its micro-batches) makes the split
    update the whole one; a pair whose prompt is long enough runs it once (last-token pooling) with the same
    result."""
    head_config = RewardHeadConfig(num_objectives=2, pooling=pooling)  # type: ignore[arg-type]
    sequences = (preference_pairs(0, 2, prompt_length=70) + preference_pairs(1, 3, first_group=2)
                 + scored_examples(2, 3, first_group=5))
    validate_batch(sequences, VOCAB)
    results = []
    for tokens, share in ((4096, False), (64, False), (4096, True)):
        config = RewardModelConfig(learning_rate=0.1, micro_batch_tokens=tokens, share_prefixes=share,
                                   max_grad_norm=None)  # fmt: skip
        events, _, _, params = train_reward_model(copy.deepcopy(sequences), config, head_config, sgd=True)
        results.append((events[0], params))
    (whole, whole_params), *others = results
    for event, params in others:
        assert event.loss == pytest.approx(whole.loss, abs=1e-5)
        assert event.metrics == pytest.approx(whole.metrics, abs=1e-5)
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(whole_params, params, strict=True))
    shared, split = results[2][0], results[1][0]
    if pooling == "last":  # the two long pairs each ran their 70-token prompt once
        assert shared.decoder_positions < whole.decoder_positions
    else:  # a mean needs the prompt's states in every row: no sharing
        assert shared.decoder_positions == whole.decoder_positions
    assert split.decoder_positions != whole.decoder_positions  # the plans really differed


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_score_sequences_batches_by_token_budget_like_scoring_one_at_a_time(pooling: str) -> None:
    model = tiny_peft_model()
    model.eval()
    head = RewardHead(32, RewardHeadConfig(num_objectives=2, pooling=pooling), seed=1)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(4)
    token_ids = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (9, 3, 5, 5)]
    shapes: list[tuple[int, ...]] = []
    decoder = model.get_base_model().get_decoder()
    hook = decoder.register_forward_pre_hook(lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)),
                                             with_kwargs=True)  # fmt: skip
    try:
        batched = score_sequences(model, token_ids, head, pad_token_id=0, token_budget=10)
    finally:
        hook.remove()
    # by length 3, 5, 5, 9: [3, 5] pads to 2 × 5 = 10 ≤ 10; a third row would be 15; 9 alone
    assert shapes == [(2, 5), (1, 5), (1, 9)]
    assert batched.shape == (4, 2)
    for index, ids in enumerate(token_ids):
        alone = score_sequences(model, [ids], head, pad_token_id=0, token_budget=10)
        assert torch.allclose(batched[index], alone[0], atol=1e-5)
    # and it is the head on the decoder's states, computed here directly
    with torch.no_grad():
        hidden = decoder_states(model, torch.tensor([token_ids[0]]), last=True)
        direct = head(hidden, torch.tensor([9]))
    assert torch.allclose(batched[0], direct[0], atol=1e-5)


# ---------------------------------------------------------------------------------------- adapters

LORA = peft_lora_config(LoraConfig(rank=4, target_modules=["q_proj", "v_proj"]), "tiny")


def perturb(module: torch.nn.Module, seed: int) -> None:
    """Make every parameter of `module` non-trivial (LoRA's B and a value head start at zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def perturb_tensor(p: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed + p.numel())
    with torch.no_grad():
        p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def lora_weights(adapters: AdapterSlots, name: str) -> list[torch.Tensor]:
    return [p.detach().clone() for p in adapters.parameters(name)]


def test_a_reward_model_step_is_a_peft_seq_cls_adapter_and_loads_back(tmp_path: Path) -> None:
    head_config = RewardHeadConfig(num_objectives=2, objective_names=["helpful", "safe"], pooling="mean",
                                   objective_weights=[0.3, 0.7])  # fmt: skip
    adapters = AdapterSlots(tiny_base(), "tiny")
    slot = adapters.create("rm", LORA, seed=0, reward_head=head_config)
    head = slot.heads["reward"]
    assert isinstance(head, RewardHead)
    for p in adapters.parameters("rm"):
        perturb_tensor(p, 1)
    perturb(head, 2)
    saved = adapters.save("rm", tmp_path / "step1")

    weights = load_file(str(saved / WEIGHTS_FILE))
    assert torch.equal(weights[SCORE_KEY], head.score.weight.detach())
    assert weights[SCORE_KEY].shape == (2, 32)
    assert any(".lora_A." in key for key in weights)
    config = orjson.loads((saved / CONFIG_FILE).read_bytes())
    assert config["task_type"] == "SEQ_CLS" and config["modules_to_save"] == ["score"]
    assert config["base_model_name_or_path"] == "tiny"
    assert RewardHeadConfig.model_validate(orjson.loads((saved / REWARD_HEAD_FILE).read_bytes())) == head_config
    assert not (saved / VALUE_HEAD_FILE).exists() and not (saved / STATE_FILE).exists()

    # A fresh trainer loads the step with its head.
    fresh = AdapterSlots(tiny_base(), "tiny")
    loaded = fresh.load("rm", saved)
    loaded_head = loaded.heads["reward"]
    assert isinstance(loaded_head, RewardHead) and loaded_head.config == head_config
    assert torch.equal(loaded_head.score.weight, head.score.weight)
    assert all(torch.equal(a, b) for a, b in zip(lora_weights(fresh, "rm"), lora_weights(adapters, "rm"), strict=True))
    assert loaded.config.task_type == "CAUSAL_LM" and not loaded.config.modules_to_save  # the head lives apart

    # The trainer that saved it, with its head changed since, gets the saved head back (and no stale optimizer).
    slot.start_optimizer(adapters.parameters("rm"), learning_rate=1e-3, weight_decay=0.0)
    perturb(head, 3)
    reloaded = adapters.load("rm", saved)
    assert torch.equal(reloaded.heads["reward"].score.weight, weights[SCORE_KEY])
    assert reloaded.optimizer is None


def test_hugging_face_loads_a_reward_step_as_a_sequence_classifier(tmp_path: Path) -> None:
    """The documented contract: PEFT puts the step on `*ForSequenceClassification` (num_labels = K) of the same
    base, whose logits (its `score` at the last token) are the scores the trainer computes."""
    adapters = AdapterSlots(tiny_base(), "tiny")
    slot = adapters.create("rm", LORA, seed=0, reward_head=RewardHeadConfig(num_objectives=2))
    for p in adapters.parameters("rm"):
        perturb_tensor(p, 1)
    perturb(slot.heads["reward"], 2)
    saved = adapters.save("rm", tmp_path / "rm1")
    adapters.model.eval()
    token_ids = [[5, 9, 13, 21, 30], [8, 8, 40]]
    ours = score_sequences(adapters.model, token_ids, slot.heads["reward"], pad_token_id=0,  # type: ignore[arg-type]
                           token_budget=64)  # fmt: skip

    base = tiny_base()
    config = copy.deepcopy(base.config)
    config.num_labels = 2
    classifier = LlamaForSequenceClassification(config)
    classifier.load_state_dict(base.state_dict(), strict=False)  # all but the LM head; `score` comes from the step
    peft_classifier = PeftModel.from_pretrained(classifier, str(saved))
    peft_classifier.eval()
    with torch.no_grad():
        theirs = torch.cat([peft_classifier(input_ids=torch.tensor([ids])).logits for ids in token_ids])
    assert torch.allclose(theirs, ours, atol=1e-5)


def test_the_scorer_is_the_reward_step_and_restores_the_active_adapter(tmp_path: Path) -> None:
    adapters = AdapterSlots(tiny_base(), "tiny")
    adapters.create("rm", LORA, seed=0, reward_head=RewardHeadConfig())
    for p in adapters.parameters("rm"):
        perturb_tensor(p, 1)
    rm_dir = adapters.save("rm", tmp_path / "rm1")
    adapters.model.eval()
    token_ids = [[5, 9, 13, 21], [8, 8, 40]]
    expected = score_sequences(adapters.model, token_ids, adapters.slot("rm").heads["reward"], pad_token_id=0,
                               token_budget=64)  # type: ignore[arg-type]  # fmt: skip

    policy = adapters.create("p", LORA, seed=1)  # now the active adapter, in training mode
    adapters.model.train()
    with adapters.scorer(rm_dir) as head:
        assert not adapters.model.training
        assert adapters.model.active_adapter == "scorer"
        got = score_sequences(adapters.model, token_ids, head, pad_token_id=0, token_budget=64)
    assert torch.allclose(got, expected, atol=1e-5)
    assert adapters.model.active_adapter == policy.key and adapters.model.training

    # A trainer with no adapter of its own yet (only scoring) gets the same scores.
    scorer_only = AdapterSlots(tiny_base(), "tiny")
    with scorer_only.scorer(rm_dir) as head:
        alone = score_sequences(scorer_only.model, token_ids, head, pad_token_id=0, token_budget=64)
    assert torch.allclose(alone, expected, atol=1e-5)


def test_a_value_head_and_the_objective_state_are_saved_and_loaded(tmp_path: Path) -> None:
    adapters = AdapterSlots(tiny_base(), "tiny")
    adapters.create("p", LORA, seed=0)
    step0 = adapters.save("p", tmp_path / "step0")  # before any PPO job: no value head, no state
    head = adapters.value_head("p")
    assert adapters.value_head("p") is head  # created once
    assert bool((head.linear.weight == 0).all()) and float(head.linear.bias.detach()) == 0.0
    perturb(head, 4)
    for p in adapters.parameters("p"):
        perturb_tensor(p, 5)
    step1 = adapters.save("p", tmp_path / "step1", state={"kl_coef": 0.07})

    assert (step1 / VALUE_HEAD_FILE).is_file() and not (step1 / REWARD_HEAD_FILE).exists()
    assert orjson.loads((step1 / STATE_FILE).read_bytes()) == {"kl_coef": 0.07}
    assert read_state(step1) == {"kl_coef": 0.07} and read_state(step0) == {}
    assert orjson.loads((step1 / CONFIG_FILE).read_bytes())["task_type"] == "CAUSAL_LM"
    assert SCORE_KEY not in load_file(str(step1 / WEIGHTS_FILE))

    fresh = AdapterSlots(tiny_base(), "tiny")
    loaded = fresh.load("p", step1)
    value = loaded.heads["value"]
    assert isinstance(value, ValueHead)
    assert torch.equal(value.linear.weight, head.linear.weight) and torch.equal(value.linear.bias, head.linear.bias)
    assert loaded.state == {"kl_coef": 0.07}
    assert all(torch.equal(a, b) for a, b in zip(lora_weights(fresh, "p"), lora_weights(adapters, "p"), strict=True))
    # saving without an explicit state carries the loaded one
    again = fresh.save("p", tmp_path / "step1-copy")
    assert read_state(again) == {"kl_coef": 0.07}

    # Rolling back to a step without a value head drops the one in memory, and its state.
    rolled_back = fresh.load("p", step0)
    assert "value" not in rolled_back.heads and rolled_back.state == {}
    assert fresh.value_head("p") is not value  # a new zero head for the next PPO job
    assert bool((fresh.value_head("p").linear.weight == 0).all())


# ---------------------------------------------------------------------------------------- batch file


def test_the_batch_file_keeps_rewards_and_targets(tmp_path: Path) -> None:
    sequences = [
        TrainSequence([1, 5, 7], [False, True, True], [0.0, -0.5, -1.0], 0.0, "a", 0, reward=2.5),
        TrainSequence([1, 6], [False, True], [0.0, -0.25], 0.0, "b", 1, targets=[0.5, NAN]),
        TrainSequence([1, 8, 9], [False, True, True], [0.0, NAN, NAN], 0.0, "c", 2, targets=[-1.0, 2.0]),
    ]
    path = tmp_path / "batch.safetensors"
    write_batch(path, sequences)
    back = read_batch(path)
    assert [s.reward for s in back] == [2.5, 0.0, 0.0]
    assert back[0].targets is None  # a row without targets reads back as None, not as NaNs
    assert back[1].targets is not None and back[1].targets[0] == 0.5 and math.isnan(back[1].targets[1])
    assert back[2].targets == [-1.0, 2.0]
    assert [s.token_ids for s in back] == [s.token_ids for s in sequences]

    plain = tmp_path / "plain.safetensors"  # no sequence with targets: no targets array, all None
    write_batch(plain, [sequences[0]])
    assert read_batch(plain)[0].targets is None and read_batch(plain)[0].reward == 2.5
