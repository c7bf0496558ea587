"""Per-token logprobs and entropies of a causal LM, in float32, without materialising all logits at once.

The vocabulary is large (49k for SmolLM2, 152k for Qwen): float32 logits of a 4096-token micro-batch would
take 0.8–2.5 GB. So the LM head runs on chunks of positions, and only on the positions that are trained
(prompts, tool results and padding need no logits). Each chunk goes through `SelectedLogprobs`, which
keeps one number per position for the backward pass (the log-normaliser) and recomputes the chunk's logits
there: the gradient of logπ(target) is g·(onehot − softmax), formed in place in one [C, V] buffer, instead
of the zero-filled scatter of gather's backward plus log_softmax's backward plus the recomputation of the
whole forward that activation checkpointing did. A 16-bit model on a CPU keeps the chunk's
log-probabilities in its own dtype instead (2 bytes a logit, 100 MB per 1,024 positions of a 49k
vocabulary): the recomputed matmul is a visible share of a bf16 GRPO step there, and log p in bf16 keeps 1 − p
precise where p is near 1 (the target's gradient); the gradient is rounded to that dtype before its
matmul anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from transformers import DynamicCache

DEFAULT_CHUNK_TOKENS = 1024


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias)  # [C, V]
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


class SelectedLogprobs(torch.autograd.Function):
    """(log softmax(hidden·Wᵀ + b)[target], entropy) per row; the entropy has a gradient only when
    `entropy_gradient` (an entropy bonus): ∂H/∂zⱼ = −pⱼ·(log pⱼ + H)."""

    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
        entropy_gradient: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = _logits(hidden, weight, bias)  # [C, V], a tensor of its own
        log_normaliser = torch.logsumexp(logits, dim=-1)  # [C]
        log_probs = logits.sub_(log_normaliser.unsqueeze(-1))  # [C, V], in place
        chosen = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [C]
        entropy = -(log_probs.exp() * log_probs).sum(dim=-1)  # H = −Σ p·log p
        # A 16-bit model on a CPU keeps log p for the backward (module docstring); others recompute the
        # logits there (on a GPU the matmul is cheap and memory is what runs out).
        kept = None
        if (hidden.dtype in (torch.float16, torch.bfloat16) and hidden.device.type == "cpu"
                and any(ctx.needs_input_grad[:3])):  # fmt: skip
            kept = log_probs.to(hidden.dtype)
        ctx.save_for_backward(hidden, weight, bias, targets, log_normaliser, entropy, kept)
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None, not zeros
        if not entropy_gradient:
            ctx.mark_non_differentiable(entropy)
        return chosen, entropy

    @staticmethod
    def backward(
        ctx: Any, grad_chosen: torch.Tensor | None, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None, None]:
        hidden, weight, bias, targets, log_normaliser, entropy, kept = ctx.saved_tensors
        if kept is not None:
            grad_logits = kept.float()  # [C, V] log p
        else:
            grad_logits = _logits(hidden, weight, bias)  # [C, V], recomputed
            grad_logits.sub_(log_normaliser.unsqueeze(-1))  # log p
        if grad_entropy is not None:
            probs = grad_logits.exp()  # [C, V]
            grad_logits.add_(entropy.unsqueeze(-1)).mul_(probs).mul_(-grad_entropy.unsqueeze(-1))  # −g_H·p·(log p + H)
            if grad_chosen is not None:
                grad_logits.sub_(probs.mul_(grad_chosen.unsqueeze(-1)))  # −g·softmax
        elif grad_chosen is not None:
            grad_logits.exp_().mul_(-grad_chosen.unsqueeze(-1))  # −g·softmax
        else:
            return None, None, None, None, None
        if grad_chosen is not None:
            grad_logits.scatter_add_(-1, targets.unsqueeze(-1), grad_chosen.unsqueeze(-1))  # + g·onehot
        grad_logits = grad_logits.to(hidden.dtype)
        grad_hidden = grad_logits @ weight if ctx.needs_input_grad[0] else None
        grad_weight = grad_logits.T @ hidden if ctx.needs_input_grad[1] else None
        grad_bias = grad_logits.sum(dim=0) if bias is not None and ctx.needs_input_grad[2] else None
        return grad_hidden, grad_weight, grad_bias, None, None


def token_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    prefix_ids: torch.Tensor | None = None,
    prefixes: PrefixFamilies | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logπ(input_ids[:, t+1] | prefix, input_ids[:, :t+1]) and the entropy of that distribution, for t < T-1.

    `model` is a transformers causal LM (or a PEFT model around one) whose logits are
    `decoder(...) @ output_embeddings.weight.T`. Takes input_ids [B, T] right-padded (no attention mask
    needed: causal attention never looks at the pads after a real token); returns two float32 [B, T-1]
    tensors; only the logprobs carry gradient. With `mask` [B, T-1], the LM head runs only where it is
    True (the trainable tokens: prompts are often most of a sequence) and the other entries are 0.

    With `prefix_ids` [P], every row continues the same P tokens (`prefixes.py`): the decoder runs over
    them once, and the rows attend to their keys and values, which carry gradient back into the prefix's
    forward pass once for the whole batch. The prefix itself gets no logprobs. `prefixes`: several families'
    prefixes in one call instead (`PrefixFamilies`).
    """
    hidden = decoder_states(model, input_ids, prefix_ids=prefix_ids, prefixes=prefixes)  # [B, T-1, H]
    return logprobs_from_states(model, hidden, input_ids[:, 1:], mask=mask, chunk_tokens=chunk_tokens)


def decoder_states(model: nn.Module, input_ids: torch.Tensor, *, prefix_ids: torch.Tensor | None = None,
                   last: bool = False, prefixes: PrefixFamilies | None = None) -> torch.Tensor:
    """The decoder's last hidden states at every position but the last ([B, T-1, H]: those that predict a
    target), or at every position with `last` ([B, T, H]: a reward head pools the last token's).

    Rows may continue shared prefixes: `prefix_ids` [P] (every row continues it) or `prefixes` (several
    families in one call, `PrefixFamilies`)."""
    causal_lm: Any = getattr(model, "get_base_model", lambda: model)()  # PEFT wraps; plain models don't
    decoder = causal_lm.get_decoder()
    if prefix_ids is not None:
        prefixes = PrefixFamilies.single(prefix_ids, input_ids.shape[0])
    rows = input_ids if last else input_ids[:, :-1]
    if prefixes is None:
        hidden: torch.Tensor = decoder(input_ids=rows, use_cache=False).last_hidden_state
        return hidden
    past = _prefix_caches(decoder, causal_lm.config, prefixes)
    if prefixes.is_single:  # the plain causal mask over the cache is already right
        hidden = decoder(input_ids=rows, past_key_values=past, use_cache=True).last_hidden_state
        return hidden
    hidden = decoder(input_ids=rows, past_key_values=past, use_cache=True, attention_mask=prefixes.attention_mask(
        rows.shape[1]), position_ids=prefixes.position_ids(rows.shape[1])).last_hidden_state
    return hidden


@dataclass(frozen=True)
class PrefixFamilies:
    """Several prefix families in one micro-batch: their prefixes run as one batch, each row continues its own.

    ids [F, P] right-padded (family f's real tokens are its first `lengths[f]`); `row_family` [B] is each
    row's family (-1: the row runs whole). A row's keys are its family's real prefix tokens then its own,
    and its positions continue its prefix (`attention_mask`, `position_ids`): the same logprobs and
    gradients as one call per family (tests/unit/test_prefixes.py), for larger and fewer matmuls.
    """

    ids: torch.Tensor  # [F, P] long
    lengths: torch.Tensor  # [F] long
    row_family: torch.Tensor  # [B] long

    @classmethod
    def single(cls, prefix_ids: torch.Tensor, rows: int) -> PrefixFamilies:
        """One prefix [P] that every row continues."""
        ids = prefix_ids.view(1, -1)
        return cls(ids, torch.tensor([ids.shape[1]], device=ids.device),
                   torch.zeros(rows, dtype=torch.long, device=ids.device))

    @property
    def is_single(self) -> bool:
        """One unpadded prefix that every row continues (the rows attend to it with a plain causal mask)."""
        return self.ids.shape[0] == 1 and bool((self.row_family == 0).all()) and int(self.lengths[0]) == self.ids.shape[1]

    def row_prefix_lengths(self) -> torch.Tensor:
        """[B] long: the real prefix tokens each row continues (0 for a row that runs whole)."""
        lengths = self.lengths[self.row_family.clamp(min=0)]
        return torch.where(self.row_family >= 0, lengths, torch.zeros_like(lengths))

    def attention_mask(self, length: int) -> torch.Tensor:
        """[B, P + T] long, transformers' 2D padding mask: row b sees its prefix's real keys and its own T
        tokens (the decoder makes it causal in cache order, in whatever form its attention takes)."""
        keys = torch.arange(self.ids.shape[1], device=self.ids.device)
        prefix = keys.view(1, -1) < self.row_prefix_lengths().view(-1, 1)  # [B, P]
        own = torch.ones((prefix.shape[0], length), dtype=torch.bool, device=self.ids.device)
        return torch.cat([prefix, own], dim=1).long()

    def position_ids(self, length: int) -> torch.Tensor:
        """[B, T] long: each row's positions continue its prefix."""
        return self.row_prefix_lengths().view(-1, 1) + torch.arange(length, device=self.ids.device).view(1, -1)


def logprobs_from_states(
    model: nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    entropy_gradient: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` from the decoder's states [B, T-1, H] that predict `targets` [B, T-1]."""
    causal_lm: Any = getattr(model, "get_base_model", lambda: model)()
    head = causal_lm.get_output_embeddings()
    if mask is None:
        mask = torch.ones_like(targets, dtype=torch.bool)  # [B, T-1]
    selected_hidden = hidden[mask]  # [N, H]
    selected_targets = targets[mask]  # [N]
    chosen: list[torch.Tensor] = []
    entropies: list[torch.Tensor] = []
    for start in range(0, selected_targets.shape[0], chunk_tokens):
        h = selected_hidden[start : start + chunk_tokens]  # [C, H]
        t = selected_targets[start : start + chunk_tokens]  # [C]
        lp, ent = SelectedLogprobs.apply(h, head.weight, head.bias, t, entropy_gradient)  # type: ignore[no-untyped-call]
        chosen.append(lp)
        entropies.append(ent)
    dtype = torch.promote_types(hidden.dtype, torch.float32)  # as `_logits`: at least float32
    empty = hidden.new_zeros(0, dtype=dtype)
    logprobs = hidden.new_zeros(targets.shape, dtype=dtype).masked_scatter(
        mask, torch.cat(chosen) if chosen else empty
    )
    entropy = hidden.new_zeros(targets.shape, dtype=dtype).masked_scatter(
        mask, torch.cat(entropies) if entropies else empty
    )
    return logprobs, entropy  # [B, T-1] each


class PrefixCacheError(RuntimeError):
    """The decoder returned no keys and values for a shared prefix (gradient checkpointing drops them)."""


def supports_prefix_sharing(model: nn.Module) -> bool:
    """Whether `token_logprobs(prefix_ids=...)` works: transformers drops the KV cache under gradient checkpointing."""
    causal_lm: Any = getattr(model, "get_base_model", lambda: model)()  # PEFT wraps; plain models don't
    return not bool(getattr(causal_lm, "is_gradient_checkpointing", False))


def _prefix_caches(decoder: nn.Module, config: Any, prefixes: PrefixFamilies) -> DynamicCache:
    """Every family's prefix keys and values from one batched call (with their autograd graph), as each row
    sees them: one prefix is expanded (a view: each row's first update concatenates its own tokens onto
    it), several are picked per row (a row that runs whole gets any family's, masked out)."""
    ids = prefixes.ids
    cache = decoder(input_ids=ids, use_cache=True).past_key_values
    if cache is None or cache.get_seq_length() != ids.shape[1]:
        raise PrefixCacheError(
            "the decoder kept no keys/values for the shared prefix (gradient checkpointing is on?)"
        )
    rows = prefixes.row_family.shape[0]
    if ids.shape[0] == 1:
        layers = [(keys.expand(rows, -1, -1, -1), values.expand(rows, -1, -1, -1)) for keys, values, *_ in cache]
    else:
        pick = prefixes.row_family.clamp(min=0)
        layers = [(keys.index_select(0, pick), values.index_select(0, pick)) for keys, values, *_ in cache]
    return DynamicCache(layers, config=config)
