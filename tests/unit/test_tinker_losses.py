"""Tinker's built-in losses (`torch_worker/objectives/tinker.py`): a worked example of each (value and gradient
with respect to the logprobs), the equalities with this project's own objectives on the same data, the
config's rules, and a training-session pass that trains with one (tiny random Llama, CPU)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from artlike_server.torch_worker.adapters import AdapterSlots
from artlike_server.torch_worker.loop import BatchError
from artlike_server.torch_worker.objectives import LossOutput, PolicyBatch, build_objective
from artlike_server.torch_worker.objectives.cispo import cispo_loss
from artlike_server.torch_worker.objectives.grpo import policy_loss
from artlike_server.torch_worker.objectives.importance_sampling import importance_sampling_loss
from artlike_server.torch_worker.objectives.sft import cross_entropy_loss
from artlike_server.torch_worker.objectives.tinker import Tinker, tinker_loss
from artlike_server.trainer_ipc import protocol
from artlike_server.trainer_ipc.batch_file import write_batch
from artlike_server.trainer_ipc.sequences import TrainSequence
from artlike_server.trainer_ipc.tinker_loss import TinkerLossConfig, TinkerLossFn
from pydantic import ValidationError

from artlike.session_types import AdamParams

from .test_training_loop import VOCAB
from .test_training_session_worker import sessions_on, step0  # noqa: F401 (a fixture)

NAN = math.nan


def value_and_grad(loss_fn: TinkerLossFn, logprobs: list[list[float]], sampling: list[list[float]],
                   coefficients: list[list[float]], mask: list[list[bool]] | None = None,
                   **options: float) -> tuple[float, list[float], LossOutput]:
    """The loss, its gradient w.r.t. the logprobs (flattened row by row) and the loss's statistics."""
    lp = torch.tensor(logprobs, dtype=torch.float64, requires_grad=True)
    keep = torch.ones_like(lp, dtype=torch.bool) if mask is None else torch.tensor(mask)
    out = tinker_loss(loss_fn, lp, torch.tensor(sampling, dtype=torch.float64),
                      torch.tensor(coefficients, dtype=torch.float64), keep, **options)  # type: ignore[arg-type]
    out.loss.backward()
    assert lp.grad is not None
    return float(out.loss.detach()), lp.grad.flatten().tolist(), out


def test_cross_entropy_is_minus_the_weighted_sum_of_logprobs() -> None:
    # Weights may be fractional or negative (the SDK's custom losses send −dL/dlogprobs); masked targets add nothing.
    loss, grad, out = value_and_grad("cross_entropy", [[-0.5, -2.0, -7.0], [-1.0, 0.0, 0.0]], [[NAN] * 3] * 2,
                                     [[1.0, -0.5, 3.0], [0.25, 0.0, 0.0]],
                                     [[True, True, False], [True, False, False]])
    assert loss == pytest.approx(-(-0.5 * 1.0 + -2.0 * -0.5) - (-1.0 * 0.25))  # = -0.25: summed over both rows
    assert grad == pytest.approx([-1.0, 0.5, 0.0, -0.25, 0.0, 0.0])
    assert float(out.tokens) == 3 and float(out.clipped) == 0


def test_importance_sampling_is_the_unclipped_ratio_times_the_token_advantage() -> None:
    # ratios e^0.5, 1 and 1 (an unknown sampling logprob counts as the current one)
    loss, grad, out = value_and_grad("importance_sampling", [[-0.5, -1.0, -3.0]], [[-1.0, -1.0, NAN]],
                                     [[2.0, -1.0, 4.0]])
    assert loss == pytest.approx(-(2.0 * math.exp(0.5) - 1.0 + 4.0))
    assert grad == pytest.approx([-2.0 * math.exp(0.5), 1.0, -4.0])  # dρ/dlogπ = ρ
    assert float(out.mismatch_tokens) == 2 and float(out.mismatch_sum) == pytest.approx(0.5)


def test_ppo_clips_the_ratio_at_its_absolute_thresholds() -> None:
    lp = [[math.log(1.5), math.log(0.5), math.log(1.1), math.log(0.5)]]  # sampling logprobs 0: ratio = exp(lp)
    loss, grad, out = value_and_grad("ppo", lp, [[0.0] * 4], [[1.0, -1.0, 1.0, 1.0]])
    # min(1.5, 1.2)=1.2 clipped; min(-0.5, -0.8)=-0.8 clipped; 1.1 inside; min(0.5, 0.8)=0.5 the ratio's
    assert loss == pytest.approx(-(1.2 - 0.8 + 1.1 + 0.5))
    assert grad == pytest.approx([0.0, 0.0, -1.1, -0.5])
    assert float(out.clipped) == 2
    wider, _, _ = value_and_grad("ppo", lp, [[0.0] * 4], [[1.0, -1.0, 1.0, 1.0]], clip_low_threshold=0.4,
                                 clip_high_threshold=2.0)
    assert wider == pytest.approx(-(1.5 - 0.5 + 1.1 + 0.5))  # no token clipped


def test_cispo_weighs_the_logprob_by_the_clipped_detached_ratio() -> None:
    lp = [[math.log(1.5), math.log(0.5), math.log(1.1), math.log(0.5)]]
    advantages = [1.0, -1.0, 1.0, 1.0]
    loss, grad, out = value_and_grad("cispo", lp, [[0.0] * 4], [advantages])
    weights = [1.2, 0.8, 1.1, 0.8]  # clip(ρ, 0.8, 1.2)
    assert loss == pytest.approx(-sum(w * x * a for w, x, a in zip(weights, lp[0], advantages, strict=True)))
    assert grad == pytest.approx([-w * a for w, a in zip(weights, advantages, strict=True)])  # every token keeps one
    assert float(out.clipped) == 3
    total, count = out.metrics["is_weight"]
    assert float(total) / float(count) == pytest.approx(sum(weights) / 4)


def test_dro_penalises_the_squared_log_ratio() -> None:
    loss, grad, out = value_and_grad("dro", [[-0.5, -1.0]], [[-1.0, NAN]], [[2.0, 1.0]], beta=0.5)
    # token 0: −(−0.5·2 − 0.5·0.5·0.5²) = 1.0625; token 1 (unknown sampling logprob: no penalty): −(−1.0·1) = 1
    assert loss == pytest.approx(1.0625 + 1.0)
    assert grad == pytest.approx([-(2.0 - 0.5 * 0.5), -1.0])  # −(A − β·(logπ − logπ_b))
    total, count = out.metrics["dro_penalty"]
    assert float(total) == pytest.approx(0.125) and float(count) == 2
    with pytest.raises(ValueError, match="beta"):
        tinker_loss("dro", torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool))


# ------------------------------------------------------------------- equal to this project's objectives


def batch_data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """3 sequences of 6 targets: logprobs, sampling logprobs near them (some unknown), advantages, mask."""
    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(3, 6, generator=g, dtype=torch.float64) * 3
    sampling = logprobs + torch.randn(3, 6, generator=g, dtype=torch.float64) * 0.4  # some ratios leave any clip
    sampling[1, 2] = NAN
    advantages = torch.tensor([1.5, -0.7, 0.3], dtype=torch.float64)
    mask = torch.rand(3, 6, generator=g) > 0.3
    mask[2] = False
    mask[2, 4] = True
    return logprobs, sampling, advantages, mask


def loss_and_grad(compute: object, logprobs: torch.Tensor) -> tuple[LossOutput, torch.Tensor]:
    leaf = logprobs.clone().requires_grad_(True)
    out: LossOutput = compute(leaf)  # type: ignore[operator]
    out.loss.backward()
    assert leaf.grad is not None
    return out, leaf.grad


def assert_equal_times(ours: tuple[LossOutput, torch.Tensor], tinker: tuple[LossOutput, torch.Tensor],
                       normalizer: float) -> None:
    assert float(tinker[0].loss.detach()) == pytest.approx(float(ours[0].loss.detach()) * normalizer, rel=1e-12)
    torch.testing.assert_close(tinker[1], ours[1] * normalizer, rtol=1e-12, atol=1e-12)
    assert float(tinker[0].clipped) == float(ours[0].clipped)
    assert float(tinker[0].tokens) == float(ours[0].tokens)
    assert float(tinker[0].mismatch_sum) == pytest.approx(float(ours[0].mismatch_sum))


def test_cross_entropy_with_unit_weights_is_sft_times_its_normaliser() -> None:
    logprobs, sampling, _, mask = batch_data()
    n = float(mask.sum())
    ours = loss_and_grad(lambda lp: cross_entropy_loss(lp, mask, normalizer=n), logprobs)
    tinker = loss_and_grad(lambda lp: tinker_loss("cross_entropy", lp, sampling, mask.double(), mask), logprobs)
    assert float(tinker[0].loss.detach()) == pytest.approx(float(ours[0].loss.detach()) * n, rel=1e-12)
    torch.testing.assert_close(tinker[1], ours[1] * n, rtol=1e-12, atol=1e-12)


def test_importance_sampling_with_sequence_advantages_is_ours_times_its_normaliser() -> None:
    logprobs, sampling, advantages, mask = batch_data(1)
    n = float(mask.sum())  # "token" aggregation
    per_token = advantages[:, None].expand_as(logprobs)
    ours = loss_and_grad(lambda lp: importance_sampling_loss(lp, sampling, advantages, mask, normalizer=n), logprobs)
    tinker = loss_and_grad(lambda lp: tinker_loss("importance_sampling", lp, sampling, per_token, mask), logprobs)
    assert_equal_times(ours, tinker, n)


def test_ppo_with_thresholds_one_minus_and_plus_epsilon_is_grpo_times_its_normaliser() -> None:
    logprobs, sampling, advantages, mask = batch_data(2)
    n = float(mask.sum())
    per_token = advantages[:, None].expand_as(logprobs)
    ours = loss_and_grad(lambda lp: policy_loss(lp, sampling, advantages, mask, epsilon_low=0.2, epsilon_high=0.28,
                                                normalizer=n), logprobs)
    tinker = loss_and_grad(lambda lp: tinker_loss("ppo", lp, sampling, per_token, mask, clip_low_threshold=0.8,
                                                  clip_high_threshold=1.28), logprobs)
    assert float(ours[0].clipped) > 0, "the data must exercise the clip"
    assert_equal_times(ours, tinker, n)


def test_cispo_has_the_gradient_of_ours_times_its_normaliser() -> None:
    """Tinker's cispo loss is the surrogate −Σ sg(w)·logπ·A, ours −Σ sg(w)·A·exp(logπ − sg(logπ)) / n: the
    gradients agree (times n), the values differ by design (ours is −Σ w·A / n)."""
    logprobs, sampling, advantages, mask = batch_data(3)
    n = float(mask.sum())
    per_token = advantages[:, None].expand_as(logprobs)
    ours = loss_and_grad(lambda lp: cispo_loss(lp, sampling, advantages, mask, epsilon_low=0.3, epsilon_high=0.28,
                                               normalizer=n), logprobs)
    tinker = loss_and_grad(lambda lp: tinker_loss("cispo", lp, sampling, per_token, mask, clip_low_threshold=0.7,
                                                  clip_high_threshold=1.28), logprobs)
    assert float(ours[0].clipped) > 0, "the data must exercise the clip"
    torch.testing.assert_close(tinker[1], ours[1] * n, rtol=1e-12, atol=1e-12)
    assert float(tinker[0].clipped) == float(ours[0].clipped) and float(tinker[0].tokens) == float(ours[0].tokens)
    weights = -tinker[1]  # = sg(w)·A on the trainable tokens, 0 elsewhere
    assert float(tinker[0].loss.detach()) == pytest.approx(-float((weights * logprobs).sum()), rel=1e-12)
    assert float(ours[0].loss.detach()) * n == pytest.approx(-float(weights.sum()), rel=1e-12)
    assert [float(x) for x in tinker[0].metrics["is_weight"]] == pytest.approx([float(x) for x in
                                                                                ours[0].metrics["is_weight"]])


# ------------------------------------------------------------------------ the seam and the config


def test_the_adapter_sums_reads_its_coefficients_and_trains_every_datum_whole() -> None:
    objective = build_objective(TinkerLossConfig(loss_fn="importance_sampling"))
    assert isinstance(objective, Tinker) and objective.name == "tinker"
    sequence = TrainSequence([1, 2, 3], [False, True, True], [0.0, -1.0, -1.0], 0.0, token_advantages=[0.0, 1.0, 2.0])
    assert objective.normalizer([sequence] * 5) == 1.0
    assert not objective.shares_prefixes and not objective.needs_reference
    logprobs = torch.tensor([[-1.0, -1.0]])
    mask = torch.tensor([[True, True]])
    batch = PolicyBatch(logprobs, mask, torch.tensor([[-1.0, -1.0]]), torch.zeros(1),
                        extras={"token_advantages": torch.tensor([[1.0, 2.0]])})
    assert float(objective.loss(batch, 1.0).loss) == pytest.approx(-3.0)
    with pytest.raises(ValueError, match="coefficients"):
        objective.loss(PolicyBatch(logprobs, mask, logprobs, torch.zeros(1)), 1.0)


def test_the_config_needs_dros_beta_and_ordered_thresholds() -> None:
    assert TinkerLossConfig(loss_fn="ppo").clip_low_threshold == 0.8
    assert TinkerLossConfig(loss_fn="ppo").clip_high_threshold == 1.2
    assert TinkerLossConfig(loss_fn="dro", beta=0.1).beta == 0.1
    with pytest.raises(ValidationError, match="beta"):
        TinkerLossConfig(loss_fn="dro")
    with pytest.raises(ValidationError):
        TinkerLossConfig(loss_fn="ppo", clip_low_threshold=1.3)
    with pytest.raises(ValidationError):
        TinkerLossConfig(loss_fn="mse")  # type: ignore[arg-type]


def test_a_pass_carries_the_config_over_the_pipe() -> None:
    from pydantic import TypeAdapter

    commands: TypeAdapter[protocol.Command] = TypeAdapter(protocol.Command)
    sent = protocol.Pass(model_name="m", batch_path="b", config=TinkerLossConfig(loss_fn="dro", beta=0.5))
    received = commands.validate_json(sent.model_dump_json())
    assert received == sent and isinstance(received.config, TinkerLossConfig)  # type: ignore[union-attr]
    job = commands.validate_json('{"cmd": "pass", "model_name": "m", "batch_path": "b", "config": {}}')
    assert job.config.objective == "grpo"  # type: ignore[union-attr]  # a job's config as before


# ------------------------------------------------------------------------------ a session's pass


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro"])
def test_a_session_pass_returns_the_loss_of_its_own_logprobs(
    loss_fn: TinkerLossFn, tmp_path: Path, step0: tuple[AdapterSlots, Path],  # noqa: F811
) -> None:
    adapters, directory = step0
    sessions = sessions_on(adapters)
    sessions.open(protocol.SessionOpen(model_name="m", adapter_dir=str(directory), optimizer=AdamParams()))
    g = torch.Generator().manual_seed(7)
    sequences = []
    for length in (7, 11):  # a Tinker datum: every target counts, each with its coefficient
        ids = torch.randint(3, VOCAB, (length,), generator=g).tolist()
        sampling = [0.0] + [-math.log(VOCAB) + 0.3 * float(x) for x in torch.randn(length - 1, generator=g)]
        sampling[3] = NAN
        coefficients = [0.0, *torch.randn(length - 1, generator=g).tolist()]
        sequences.append(TrainSequence(ids, [False] + [True] * (length - 1), sampling, 0.0,
                                       token_advantages=coefficients))
    path = tmp_path / "tinker.batch"
    write_batch(path, sequences)
    config = TinkerLossConfig(loss_fn=loss_fn, beta=0.3)
    done = sessions.run_pass(protocol.Pass(model_name="m", batch_path=str(path), config=config))
    assert done.objective == "tinker" and done.tokens == 6 + 10
    assert any(p.grad is not None for p in adapters.parameters("m"))

    expected = 0.0
    for sequence, returned in zip(sequences, done.logprobs, strict=True):
        def row(values: list[float]) -> torch.Tensor:
            return torch.tensor([values[1:]], dtype=torch.float32)

        logprobs = row([0.0 if v is None else v for v in returned])
        assert sequence.token_advantages is not None
        expected += float(tinker_loss(loss_fn, logprobs, row(sequence.behaviour_logprobs), row(sequence.token_advantages),
                                      torch.ones_like(logprobs, dtype=torch.bool), beta=0.3).loss)
    # float32 throughout: the returned logprobs are the ones the loss used; only the summation order differs
    assert done.loss == pytest.approx(expected, rel=1e-5, abs=1e-5)

    bare = TrainSequence(sequences[0].token_ids, sequences[0].trainable, sequences[0].behaviour_logprobs, 0.0)
    write_batch(path, [sequences[1], bare])
    with pytest.raises(BatchError, match="sequence 1 has no token_advantages"):
        sessions.run_pass(protocol.Pass(model_name="m", batch_path=str(path), config=config))
