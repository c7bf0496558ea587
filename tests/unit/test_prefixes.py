"""Shared-prefix training (`training/prefixes.py`): which sequences share, and that sharing changes nothing.

Planning is checked on worked examples and on random batches; exactness on a tiny random Llama: the logprobs,
their gradients and whole optimizer steps with shared prefixes equal those of whole sequences.
"""

from __future__ import annotations

import random

import pytest
import torch
from artlike_server.torch_worker import attention
from artlike_server.torch_worker.logprobs import (
    PrefixCacheError,
    PrefixFamilies,
    supports_prefix_sharing,
    token_logprobs,
)
from artlike_server.torch_worker.loop import collate, plan_step, run_optimizer_steps
from artlike_server.torch_worker.packing import MicroBatchPlan, plan_micro_batches
from artlike_server.torch_worker.prefixes import (
    Family,
    common_prefix_length,
    first_needed_position,
    plan_families,
)
from artlike_server.trainer_ipc.sequences import TrainSequence

from artlike.types import GRPOConfig, StepEvent
from tests.unit.test_training_loop import VOCAB, tiny_peft_model

# ------------------------------------------------------------------------------------------- planning


def test_first_needed_position_is_the_position_that_predicts_the_first_trained_token() -> None:
    assert first_needed_position([False, False, True]) == 1
    assert first_needed_position([True, False, False, True]) == 2  # token 0 is never a target
    assert first_needed_position([False, False]) is None
    assert common_prefix_length([4, 5, 6], [4, 5, 6, 7]) == 3


def test_a_group_sharing_its_prompt_is_one_family() -> None:
    prompt = list(range(10, 30))  # 20 tokens
    group = [[*prompt, 40 + i, 50 + i, 60] for i in range(4)]  # each sample: 3 sampled tokens
    other = [7, 8, 9, 1, 2]
    families = plan_families([*group, other], [19, 19, 19, 19, 2], call_overhead=0)
    assert sorted(families, key=lambda f: f.members) == [Family((0, 1, 2, 3), 19), Family((4,), 0)]
    # 19 shared positions once, then 3 each (positions = length - 1: 22 per sample): 31 instead of 88


def test_the_prefix_stops_before_the_first_position_any_member_needs() -> None:
    prompt = list(range(10, 30))  # 20 tokens
    late = [*prompt, 7, 8]  # trained from token 20: first needed position 19
    short = [*prompt, 1, 2]  # trained from token 9 (say, a turn inside the prompt): first needed 8
    early = [*prompt[:12], 99, *prompt[13:], 5, 6]  # leaves the prompt at token 12; first needed 19
    # Positions (length - 1): 21 each, 63 alone. All three sharing 8 tokens: 8 + 3 * 13 = 47; the best pair
    # (late, early: 12 shared) plus short alone: 12 + 9 + 9 + 21 = 51; (short, late: 8) plus early: 55.
    assert plan_families([late, short, early], [19, 8, 19], call_overhead=0) == [Family((0, 1, 2), 8)]
    # A second pass costing 4 positions still does not pay for the longer prefix of the pair.
    assert plan_families([late, short, early], [19, 8, 19], call_overhead=4) == [Family((0, 1, 2), 8)]


def test_two_groups_with_a_common_system_prompt_get_a_family_each() -> None:
    system = list(range(100, 110))  # shared by everyone
    groups = [[system + [200 + g] * 10 + [300 + s, 301] for s in range(4)] for g in range(2)]
    sequences = groups[0] + groups[1]
    families = plan_families(sequences, [19] * 8, call_overhead=0)
    # Two families sharing 20 tokens each beat one sharing only the 10-token system prompt.
    assert sorted(f.members for f in families) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert {f.prefix_length for f in families} == {19}  # capped at the first needed position


def test_a_few_shared_tokens_are_not_worth_a_separate_pass() -> None:
    sequences = [[1, 2, 3, 10 + i, 20, 21, 22] for i in range(2)]
    assert plan_families(sequences, [4, 4], call_overhead=64) == [Family((0,), 0), Family((1,), 0)]
    assert plan_families(sequences, [4, 4], call_overhead=0) == [Family((0, 1), 3)]


def test_planning_refuses_sequences_without_a_trained_token() -> None:
    with pytest.raises(ValueError, match="trained token"):
        plan_families([[1, 2, 3]], [2])  # first needed 2 = last position: nothing after it
    with pytest.raises(ValueError, match="differ in length"):
        plan_families([[1, 2, 3]], [])


@pytest.mark.parametrize("seed", range(20))
def test_random_batches_plan_into_valid_families_that_never_cost_more(seed: int) -> None:
    rng = random.Random(seed)
    prompts = [[rng.randrange(50) for _ in range(rng.randint(1, 30))] for _ in range(rng.randint(1, 4))]
    sequences, first_needed = [], []
    for _ in range(rng.randint(1, 24)):
        prompt = rng.choice(prompts)[: rng.randint(1, 30)]
        sequence = prompt + [rng.randrange(50) for _ in range(rng.randint(1, 8))]
        sequences.append(sequence)
        first_needed.append(rng.randint(0, len(sequence) - 2))
    families = plan_families(sequences, first_needed, call_overhead=rng.choice([0, 4, 64]))
    assert sorted(m for f in families for m in f.members) == list(range(len(sequences)))
    cost = 0
    for family in families:
        p = family.prefix_length
        members = [sequences[m] for m in family.members]
        assert p == 0 or len(members) >= 2
        assert all(m[:p] == members[0][:p] and p <= first_needed[i] for m, i in zip(members, family.members, strict=True))
        cost += p + sum(len(m) - 1 - p for m in members)
    assert cost <= sum(len(s) - 1 for s in sequences)


def test_a_family_fills_its_own_micro_batches_and_the_rest_is_packed() -> None:
    plans = plan_micro_batches([50, 60, 70, 20, 30], [Family((0, 1, 2), 40), Family((3,), 0), Family((4,), 0)],
                               token_budget=100)  # fmt: skip
    assert plans == [MicroBatchPlan((2, 1), ((40, 2),)), MicroBatchPlan((0,), ((40, 1),)), MicroBatchPlan((4, 3))]


# ------------------------------------------------------------------------------------------- exactness


def _model() -> torch.nn.Module:
    return tiny_peft_model().double()


def test_logprobs_and_gradients_with_a_shared_prefix_equal_whole_sequences() -> None:
    model = _model()
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, VOCAB, (9,), generator=g)
    rows = torch.randint(0, VOCAB, (3, 6), generator=g)  # what each of 3 sequences adds after the prefix
    whole = torch.cat([prefix.expand(3, -1), rows], dim=1)  # [3, 15]

    results = []
    for kwargs in ({"input_ids": whole}, {"input_ids": rows, "prefix_ids": prefix}):
        model.zero_grad()
        logprobs, entropy = token_logprobs(model, **kwargs)
        if "prefix_ids" not in kwargs:  # whole sequences: keep what the rows' targets are
            logprobs, entropy = logprobs[:, 9:], entropy[:, 9:]
        weights = torch.linspace(-1, 2, logprobs.numel(), dtype=logprobs.dtype).view_as(logprobs)
        (logprobs * weights).sum().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
        results.append((logprobs.detach(), entropy, grads))
    (lp_whole, ent_whole, grads_whole), (lp_shared, ent_shared, grads_shared) = results
    assert lp_shared.shape == (3, 5)
    torch.testing.assert_close(lp_shared, lp_whole)
    torch.testing.assert_close(ent_shared, ent_whole)
    assert any(float(g.abs().sum()) > 0 for g in grads_whole)
    for a, b in zip(grads_whole, grads_shared, strict=True):
        torch.testing.assert_close(a, b)  # the prefix's share of the gradient arrives through its keys/values


@pytest.mark.parametrize("implementation", ["sdpa", attention.NAME])
def test_several_families_in_one_call_equal_whole_sequences(implementation: str) -> None:
    """Two families with prefixes of different lengths and a row that runs whole, in one decoder call: the
    padded prefix's keys are masked and each row's positions continue its own prefix (with SDPA and with
    the CPU trainer's attention, which reads the mask itself)."""
    model = _model()
    attention.register()
    model.get_base_model().set_attn_implementation(implementation)
    g = torch.Generator().manual_seed(1)
    long_prefix, short_prefix = torch.randint(0, VOCAB, (9,), generator=g), torch.randint(0, VOCAB, (5,), generator=g)
    rests = [torch.randint(0, VOCAB, (n,), generator=g) for n in (6, 4, 7, 3)]  # 2 rows of each family
    whole_row = torch.randint(0, VOCAB, (8,), generator=g)
    prefixes = [long_prefix, long_prefix, short_prefix, short_prefix]
    sequences = [torch.cat([p, r]) for p, r in zip(prefixes, rests, strict=True)] + [whole_row]
    weights = [torch.linspace(-1, 2, len(r) - 1, dtype=torch.float64) for r in [*rests, whole_row]]

    model.zero_grad()
    whole = []
    for sequence, prefix_length, weight in zip(sequences, [9, 9, 5, 5, 0], weights, strict=True):
        logprobs, _ = token_logprobs(model, sequence.view(1, -1))
        whole.append(logprobs[0, prefix_length:].detach())
        (logprobs[0, prefix_length:] * weight).sum().backward()
    grads_whole = [p.grad.clone() for p in model.parameters() if p.requires_grad]

    model.zero_grad()
    rows = torch.zeros((5, 8), dtype=torch.long)
    for row, rest in enumerate([*rests, whole_row]):
        rows[row, : len(rest)] = rest
    ids = torch.zeros((2, 9), dtype=torch.long)
    ids[0], ids[1, :5] = long_prefix, short_prefix
    families = PrefixFamilies(ids, torch.tensor([9, 5]), torch.tensor([0, 0, 1, 1, -1]))
    assert not families.is_single
    logprobs, _ = token_logprobs(model, rows, prefixes=families)
    total = torch.zeros((), dtype=torch.float64)
    for row, (rest, weight) in enumerate(zip([*rests, whole_row], weights, strict=True)):
        torch.testing.assert_close(logprobs[row, : len(rest) - 1].detach(), whole[row])
        total = total + (logprobs[row, : len(rest) - 1] * weight).sum()
    total.backward()
    for a, b in zip(grads_whole, [p.grad for p in model.parameters() if p.requires_grad], strict=True):
        torch.testing.assert_close(a, b)


def test_many_small_groups_share_one_micro_batch() -> None:
    """8 prompts × 4 samples (an RL step's shape): one decoder call for all the prompts, one for all the samples."""
    sequences = grpo_groups(groups=8, system=0, prompt=(40,) * 8)
    plans = plan_step(sequences, token_budget=4096, share_prefixes=True)
    assert len(plans) == 1 and plans[0].families == ((39, 4),) * 8
    assert sorted(plans[0].members) == list(range(32))
    lengths = [s.num_tokens for s in sequences]
    # 8 prefixes of 39 tokens (up to the position that predicts the first sampled token), then 32 rows of the
    # prompt's last token and up to 9 sampled ones (the last is only a target)
    assert plans[0].decoder_positions(lengths) == 8 * 39 + 32 * (1 + 9 - 1)
    tight = plan_step(sequences, token_budget=200, share_prefixes=True)
    assert all(plan.decoder_positions(lengths) <= 200 for plan in tight) and len(tight) > 1


@pytest.mark.parametrize(("micro_batch_tokens", "calls"), [(4096, [3]), (200, [2, 1])])
def test_an_optimizer_step_over_many_families_equals_one_without(micro_batch_tokens: int, calls: list[int]) -> None:
    sequences = grpo_groups(groups=3, system=0, prompt=(38, 45, 30))
    plans = plan_step(sequences, micro_batch_tokens, share_prefixes=True)
    assert [[p for p, _ in plan.families] for plan in plans] == ([[44, 37, 29]] if calls == [3] else [[44, 37], [29]])
    whole_events, whole_params = _train(False, micro_batch_tokens, sequences=sequences)
    shared_events, shared_params = _train(True, micro_batch_tokens, sequences=sequences)
    for a, b in zip(whole_params, shared_params, strict=True):
        torch.testing.assert_close(a, b)
    for field in ("loss", "policy_loss", "grad_norm", "entropy", "logprob_mismatch"):
        assert getattr(shared_events[0], field) == pytest.approx(getattr(whole_events[0], field), rel=1e-7, abs=1e-12)
    assert shared_events[0].decoder_positions < whole_events[0].decoder_positions


def grpo_groups(seed: int = 2, *, groups: int = 2, system: int = 12,
                prompt: tuple[int, ...] = ()) -> list[TrainSequence]:
    """`groups` groups of four samples: each group shares a prompt (8 tokens, or `prompt[g]`) after a
    system prompt of `system` tokens that all groups share."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, VOCAB, (system,), generator=g).tolist()
    sequences = []
    for group in range(groups):
        prompt_ids = shared + torch.randint(3, VOCAB, (prompt[group] if prompt else 8,), generator=g).tolist()
        for sample in range(4):
            sampled = torch.randint(3, VOCAB, (3 + 2 * sample,), generator=g).tolist()
            ids = prompt_ids + sampled
            trainable = [i >= len(prompt_ids) for i in range(len(ids))]
            behaviour = [-3.0 - 0.05 * i if t else 0.0 for i, t in enumerate(trainable)]
            sequences.append(TrainSequence(ids, trainable, behaviour, advantage=(-1.0) ** sample * (1 + group)))
    return sequences


def _train(share: bool, micro_batch_tokens: int, kl_beta: float = 0.0,
           sequences: list[TrainSequence] | None = None) -> tuple[list[StepEvent], list[torch.Tensor]]:
    model = _model()
    params = [p for p in model.parameters() if p.requires_grad]
    config = GRPOConfig(learning_rate=0.1, micro_batch_tokens=micro_batch_tokens, max_grad_norm=None,
                         kl_beta=kl_beta, share_prefixes=share)  # fmt: skip
    events: list[StepEvent] = []
    run_optimizer_steps(model, torch.optim.SGD(params, lr=0.1), sequences or grpo_groups(), config, pad_token_id=0,
                        on_step=events.append, reference=model.disable_adapter if kl_beta else None)  # fmt: skip
    return events, [p.detach().clone() for p in params]


@pytest.mark.parametrize(("micro_batch_tokens", "kl_beta"), [(4096, 0.0), (64, 0.0), (4096, 0.1)])
def test_an_optimizer_step_with_shared_prefixes_equals_one_without(micro_batch_tokens: int, kl_beta: float) -> None:
    plans = plan_step(grpo_groups(), micro_batch_tokens, share_prefixes=True)
    # One family over the 12-token system prompt: two families over each group's 20-token prompt would save
    # 30 positions but cost a second pass (64).
    assert {prefix for plan in plans for prefix, _ in plan.families} == {12}
    assert sorted(m for p in plans for m in p.members) == list(range(8))
    whole_events, whole_params = _train(False, micro_batch_tokens, kl_beta)
    shared_events, shared_params = _train(True, micro_batch_tokens, kl_beta)
    for a, b in zip(whole_params, shared_params, strict=True):
        torch.testing.assert_close(a, b)
    # rel 1e-7: transformers' RMSNorm computes in float32 even in a float64 model, so a different order of
    # the same work moves gradients by ~1e-9 (eager vs SDPA attention on whole sequences differ as much).
    for field in ("loss", "policy_loss", "kl", "grad_norm", "entropy", "clip_fraction", "logprob_mismatch"):
        assert getattr(shared_events[0], field) == pytest.approx(getattr(whole_events[0], field), rel=1e-7, abs=1e-12)
    assert shared_events[0].tokens == whole_events[0].tokens
    assert shared_events[0].decoder_positions < whole_events[0].decoder_positions
    if micro_batch_tokens == 4096:  # one micro-batch: 8 rows of the longest (29 tokens: 28 positions), or
        assert whole_events[0].decoder_positions == 8 * 28  # the 12 shared tokens once and 8 rows of 16
        assert shared_events[0].decoder_positions == 12 + 8 * 16


def test_collate_after_a_prefix_keeps_only_what_follows_it() -> None:
    seqs = [
        TrainSequence([1, 2, 3, 5, 6], [False, False, False, True, True], [0.0, 0.0, 0.0, -0.5, -0.6], 2.0),
        TrainSequence([1, 2, 3, 7], [False, False, False, True], [0.0, 0.0, 0.0, -0.7], -1.0),
    ]
    mb = collate(seqs, pad_token_id=0, families=[(2, 2)])
    assert mb.prefixes is not None and mb.prefixes.ids.tolist() == [[1, 2]] and mb.prefixes.is_single
    assert mb.input_ids.tolist() == [[3, 5, 6], [3, 7, 0]]
    assert mb.mask.tolist() == [[True, True], [True, False]]
    torch.testing.assert_close(mb.behaviour_logprobs, torch.tensor([[-0.5, -0.6], [-0.7, 0.0]]))
    with pytest.raises(ValueError, match="do not share"):
        collate(seqs, pad_token_id=0, families=[(3, 2)])  # token 3 of the first sequence is trained
    with pytest.raises(ValueError, match="do not share"):
        collate([seqs[0], TrainSequence([9, 2, 3, 7], [False] * 3 + [True], [0.0] * 4, 1.0)], 0, families=[(2, 2)])


def test_gradient_checkpointing_turns_sharing_off_instead_of_dropping_the_prefix() -> None:
    model = _model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    assert not supports_prefix_sharing(model)
    with pytest.raises(PrefixCacheError):
        token_logprobs(model, torch.tensor([[5, 6, 7]]), prefix_ids=torch.tensor([1, 2, 3]))
    events, _ = _train_checkpointed(model)
    assert events[0].tokens == sum(s.num_trainable_tokens for s in grpo_groups())


def _train_checkpointed(model: torch.nn.Module) -> tuple[list[StepEvent], None]:
    params = [p for p in model.parameters() if p.requires_grad]
    events: list[StepEvent] = []
    run_optimizer_steps(model, torch.optim.SGD(params, lr=0.1), grpo_groups(), GRPOConfig(max_grad_norm=None),
                        pad_token_id=0, on_step=events.append)  # fmt: skip
    return events, None
