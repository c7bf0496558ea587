"""The CPU trainer's attention (`torch_worker/attention.py`): the same outputs and gradients as SDPA, in every mask
form transformers hands it, and SDPA itself past the size where the matmul form stops paying."""

from __future__ import annotations

import pytest
import torch
from artlike_server.torch_worker import attention
from artlike_server.torch_worker.logprobs import token_logprobs
from torch.nn import functional as F

from tests.unit.test_training_loop import VOCAB, tiny_peft_model


class _Layer(torch.nn.Module):
    """What the attention function reads of its module."""

    is_causal = True
    num_key_value_groups = 3


def _inputs(batch: int, queries: int, keys: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(batch, 6, queries, 8), (batch, 2, keys, 8), (batch, 2, keys, 8)]  # 6 query heads, 2 key/value heads
    return [torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True) for shape in shapes]


def _reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """SDPA with the key/value heads repeated for their query heads; [B, T, H, D]."""
    key, value = key.repeat_interleave(3, dim=1), value.repeat_interleave(3, dim=1)
    if mask is None:  # causal, the queries being the last positions
        t, s = query.shape[2], key.shape[2]
        mask = torch.ones(t, s, dtype=torch.bool).tril(s - t)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask).transpose(1, 2)


def _padding_mask(batch: int, queries: int, keys: int) -> torch.Tensor:
    """[B, 1, T, S] bool: causal over the last T positions, and row 0 does not see its first 3 keys."""
    mask = torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries).expand(batch, 1, queries, keys).clone()
    mask[0, :, :, :3] = False
    return mask


@pytest.mark.parametrize(
    ("queries", "keys", "mask_kind"),
    [(7, 7, "none"), (5, 12, "none"), (5, 12, "bool"), (5, 12, "additive")],
)
def test_outputs_and_gradients_equal_sdpa(queries: int, keys: int, mask_kind: str) -> None:
    mask = None if mask_kind == "none" else _padding_mask(2, queries, keys)
    results = []
    for use_grouped in (False, True):
        query, key, value = _inputs(2, queries, keys)
        if not use_grouped:
            output = _reference(query, key, value, mask)
        else:
            given = mask
            if mask is not None and mask_kind == "additive":
                given = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, float("-inf"))
            output, weights = attention.grouped_attention(_Layer(), query, key, value, given)
            assert weights is None and output.shape == (2, queries, 6, 8)
        weight = torch.linspace(-1, 1, output.numel(), dtype=torch.float64).view_as(output)
        (output * weight).sum().backward()
        results.append((output.detach(), query.grad, key.grad, value.grad))
    for expected, actual in zip(*results, strict=True):
        torch.testing.assert_close(actual, expected)


def test_large_score_matrices_go_to_sdpa() -> None:
    small, large = _inputs(1, 8, 8), _inputs(1, 8, attention.SMALL_SCORES // 48 + 1)
    small_out, _ = attention.grouped_attention(_Layer(), *small, None)
    large_out, _ = attention.grouped_attention(_Layer(), *large, torch.ones(1, 1, 8, large[1].shape[2], dtype=torch.bool))
    assert "ScaledDotProduct" not in type(small_out.grad_fn.next_functions[0][0]).__name__  # type: ignore[union-attr]
    names = []
    node = large_out.grad_fn
    while node is not None and len(names) < 6:
        names.append(type(node).__name__)
        node = node.next_functions[0][0] if node.next_functions else None
    assert any("ScaledDotProduct" in name for name in names), names


def test_a_model_loaded_with_it_gives_the_same_logprobs_and_gradients() -> None:
    name = attention.register()
    results = []
    for implementation in ("sdpa", name):
        model = tiny_peft_model().double()
        model.get_base_model().set_attn_implementation(implementation)
        ids = torch.randint(0, VOCAB, (3, 20), generator=torch.Generator().manual_seed(4))
        logprobs, _ = token_logprobs(model, ids, prefix_ids=torch.tensor([5, 6, 7, 8]))
        logprobs.sum().backward()
        results.append((logprobs.detach(), [p.grad for p in model.parameters() if p.requires_grad]))
    assert results[1][1] and all(float(g.abs().sum()) > 0 for g in results[1][1])
    torch.testing.assert_close(results[1][0], results[0][0])
    for actual, expected in zip(results[1][1], results[0][1], strict=True):
        torch.testing.assert_close(actual, expected)
