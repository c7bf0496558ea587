"""Per-token logprobs and entropies of a causal LM, in float32, without materialising all logits at once.

The vocabulary is large (49k for SmolLM2, 152k for Qwen): float32 logits of a 4096-token micro-batch would
take 0.8–2.5 GB, plus as much again for the log-softmax autograd keeps. So the LM head runs on chunks of
positions, each under activation checkpointing: autograd keeps only the chunk's hidden states, and the
backward pass recomputes that chunk's logits (one extra LM-head matmul, a few % of the step).
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
    logits = F.linear(hidden, weight, bias).float()  # [B, C, V] in float32 whatever the model dtype
    log_probs = logits.log_softmax(dim=-1)  # [B, C, V]
    chosen = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [B, C]
    with torch.no_grad():
        entropy = -(log_probs.exp() * log_probs).sum(dim=-1)  # [B, C]
    return chosen, entropy


def token_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    *,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logπ(input_ids[:, t+1] | input_ids[:, :t+1]) and the entropy of that distribution, for t < T-1.

    `model` is a transformers causal LM (or a PEFT model around one) whose logits are
    `decoder(...) @ output_embeddings.weight.T`. Takes input_ids [B, T] right-padded (no attention mask
    needed: causal attention never looks at the pads after a real token); returns two float32 [B, T-1]
    tensors; only the logprobs carry gradient.
    """
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = causal_lm.get_decoder()
    head = causal_lm.get_output_embeddings()
    hidden = decoder(input_ids=input_ids[:, :-1], use_cache=False).last_hidden_state  # [B, T-1, H]
    targets = input_ids[:, 1:]  # [B, T-1]
    rows = max(1, chunk_tokens // max(1, input_ids.shape[0]))  # positions per chunk, all B rows at once
    chosen: list[torch.Tensor] = []
    entropies: list[torch.Tensor] = []
    for start in range(0, targets.shape[1], rows):
        h = hidden[:, start : start + rows]  # [B, C, H]
        t = targets[:, start : start + rows]  # [B, C]
        if torch.is_grad_enabled():
            lp, ent = checkpoint(_chunk_logprobs, h, head.weight, head.bias, t, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(h, head.weight, head.bias, t)
        chosen.append(lp)
        entropies.append(ent)
    return torch.cat(chosen, dim=1), torch.cat(entropies, dim=1)
