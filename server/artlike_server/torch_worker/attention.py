"""Attention for the CPU trainer: small score matrices as grouped matmuls, the rest through SDPA.

An RL step on a CPU trains short rows: a group's samples (tens of tokens) attending to their shared prompt
(a few hundred, `prefixes.py`). There, torch's CPU flash attention is the slowest part of the step after
the matmuls: its backward takes a far larger share of a GRPO step than of its FLOPs
(bench/train_throughput.py measures the step). For a small [T, S] score matrix the plain formulation is
faster: softmax(q·kᵀ)·v as two batched matmuls, with the query heads that share a key/value head
(grouped-query attention) stacked into one matmul against that head instead of repeating its keys. For
long causal rows flash attention is faster, since it skips the masked half and keeps no score matrix. So
the matmul form takes score matrices up to `SMALL_SCORES` elements and SDPA takes the rest (the matmul
form also keeps its scores for the backward: `SMALL_SCORES` bounds that memory at ~9 MB a layer).

It is registered with transformers' `AttentionInterface` (its documented plug-in point) under `NAME`,
with SDPA's mask builder, and chosen when the trainer loads a model on a CPU (`worker.py`).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

NAME = "artlike_grouped"
SMALL_SCORES = 1_500_000
"""Largest score matrix (rows × heads × queries × keys) computed as matmuls; larger ones go to SDPA."""


def grouped_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, H, T, D]
    key: torch.Tensor,  # [B, K, S, D]: K key/value heads, each shared by H / K query heads
    value: torch.Tensor,  # [B, K, S, D]
    attention_mask: torch.Tensor | None,  # [B, 1, T, S] bool (True: attend) or additive; None: causal
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; returns the output as [B, T, H, D]."""
    batch, heads, queries, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    if dropout or batch * heads * queries * keys > SMALL_SCORES or not getattr(module, "is_causal", True):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)  # fmt: skip
    groups = heads // kv_heads
    scale = dim**-0.5 if scaling is None else scaling
    # Query heads h = k·groups + g use key/value head k: stacked, they are one [groups·T, S] matmul per head.
    # The scale goes on the queries (T·D numbers, not T·S), as SDPA does.
    stacked = (query * scale).reshape(batch, kv_heads, groups * queries, dim)
    scores = (stacked @ key.transpose(-1, -2)).view(batch, kv_heads, groups, queries, keys)
    # A 16-bit model's scores go to float32 for the softmax. The mask below writes in place: into that copy,
    # or into the matmul's own output, which its backward does not keep.
    scores = scores.float() if scores.dtype in (torch.float16, torch.bfloat16) else scores
    if attention_mask is None:  # causal, the queries being the last T of the S positions
        allowed = torch.ones(queries, keys, dtype=torch.bool, device=query.device).tril(keys - queries)
        scores.masked_fill_(~allowed, float("-inf"))
    elif attention_mask.dtype == torch.bool:
        scores.masked_fill_(~attention_mask.unsqueeze(2), float("-inf"))  # [B, 1, 1, T, S]
    else:
        scores = scores + attention_mask.unsqueeze(2).float()
    probs = scores.softmax(dim=-1).to(value.dtype).view(batch, kv_heads, groups * queries, keys)
    output = (probs @ value).view(batch, heads, queries, dim)  # [B, H, T, D]
    return output.transpose(1, 2).contiguous(), None


def register() -> str:
    """Make `NAME` an attention implementation transformers models can be loaded with; returns it."""
    AttentionInterface.register(NAME, grouped_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    return NAME
