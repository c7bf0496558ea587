"""Per-token logprobs and entropies of a causal LM, in float32, without materialising all logits at once.

The vocabulary is large (49k for SmolLM2, 152k for Qwen): float32 logits of a 4096-token micro-batch would
take 0.8–2.5 GB, plus as much again for the log-softmax autograd keeps. So the LM head runs on chunks of
positions, each under activation checkpointing: autograd keeps only the chunk's hidden states, and the
backward pass recomputes that chunk's logits (one extra LM-head matmul, a few % of the step). The head
runs only on the positions that are trained: prompts, tool results and padding need no logits.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

DEFAULT_CHUNK_TOKENS = 1024


def _chunk_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = F.linear(hidden, weight, bias).float()  # [N, V] in float32 whatever the model dtype
    log_probs = logits.log_softmax(dim=-1)  # [N, V]
    chosen = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [N]
    with torch.no_grad():
        entropy = -(log_probs.exp() * log_probs).sum(dim=-1)  # [N]
    return chosen, entropy


def token_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logπ(input_ids[:, t+1] | input_ids[:, :t+1]) and the entropy of that distribution, for t < T-1.

    `model` is a transformers causal LM (or a PEFT model around one) whose logits are
    `decoder(...) @ output_embeddings.weight.T`. Takes input_ids [B, T] right-padded (no attention mask
    needed: causal attention never looks at the pads after a real token); returns two float32 [B, T-1]
    tensors; only the logprobs carry gradient. With `mask` [B, T-1], the LM head runs only where it is
    True (the trainable tokens: prompts are often most of a sequence) and the other entries are 0.
    """
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = causal_lm.get_decoder()
    head = causal_lm.get_output_embeddings()
    hidden = decoder(input_ids=input_ids[:, :-1], use_cache=False).last_hidden_state  # [B, T-1, H]
    targets = input_ids[:, 1:]  # [B, T-1]
    if mask is None:
        mask = torch.ones_like(targets, dtype=torch.bool)  # [B, T-1]
    selected_hidden = hidden[mask]  # [N, H]
    selected_targets = targets[mask]  # [N]
    chosen: list[torch.Tensor] = []
    entropies: list[torch.Tensor] = []
    for start in range(0, selected_targets.shape[0], chunk_tokens):
        h = selected_hidden[start : start + chunk_tokens]  # [C, H]
        t = selected_targets[start : start + chunk_tokens]  # [C]
        if torch.is_grad_enabled():
            lp, ent = checkpoint(_chunk_logprobs, h, head.weight, head.bias, t, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(h, head.weight, head.bias, t)
        chosen.append(lp)
        entropies.append(ent)
    empty = hidden.new_zeros(0, dtype=torch.float32)
    logprobs = hidden.new_zeros(targets.shape, dtype=torch.float32).masked_scatter(
        mask, torch.cat(chosen) if chosen else empty
    )
    entropy = hidden.new_zeros(targets.shape, dtype=torch.float32).masked_scatter(
        mask, torch.cat(entropies) if entropies else empty
    )
    return logprobs, entropy  # [B, T-1] each
