"""Tinker datums as the trainer's sequences, and `loss_fn` with its config as the trainer's loss config.

A datum is `model_input` (N tokens) and per-target arrays of N rows: `target_tokens` (the token predicted
at each position), `weights` (cross_entropy) or `logprobs` + `advantages` (the policy-gradient losses).
This server trains next-token targets of one sequence, so `target_tokens` must be `model_input` shifted by
one; the sequence is then `model_input + [last target]`, every target scored, with its weight or advantage
as the target's coefficient (a 0 leaves the token out of the loss but not out of the returned logprobs).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from pydantic import ValidationError

from ..errors import InvalidRequest
from ..trainer_ipc.sequences import UNKNOWN_LOGPROB, TrainSequence
from ..trainer_ipc.tinker_loss import TinkerLossConfig
from .wire import WireDatum

LOSS_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
    "dro": ("target_tokens", "logprobs", "advantages"),
}
"""The built-in losses this server trains, with the `loss_fn_inputs` each needs."""
_CONFIG_KEYS = {"ppo": ("clip_low_threshold", "clip_high_threshold"),
                "cispo": ("clip_low_threshold", "clip_high_threshold"), "dro": ("beta",)}


def loss_config(loss_fn: str, config: Mapping[str, float | str], micro_batch_tokens: int | None = None
                ) -> TinkerLossConfig:
    if loss_fn not in LOSS_INPUTS:
        raise InvalidRequest(f"loss_fn {loss_fn!r} is not served here: use one of {', '.join(LOSS_INPUTS)} (or "
                             "forward_backward_custom, which runs on cross_entropy)", param="loss_fn",
                             code="unsupported_loss")
    allowed = _CONFIG_KEYS.get(loss_fn, ())
    unknown = sorted(set(config) - set(allowed))
    if unknown:
        raise InvalidRequest(f"loss_fn_config key(s) {unknown} do not apply to {loss_fn!r} (it takes "
                             f"{list(allowed) or 'none'})", param="loss_fn_config", code="invalid_loss_config")
    options: dict[str, object] = {"loss_fn": loss_fn, **config}
    if micro_batch_tokens is not None:
        options["micro_batch_tokens"] = micro_batch_tokens
    try:
        return TinkerLossConfig.model_validate(options)
    except ValidationError as error:
        detail = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
        raise InvalidRequest(f"loss_fn_config for {loss_fn!r}: {detail}", param="loss_fn_config",
                             code="invalid_loss_config") from None


def datum_sequences(data: Sequence[WireDatum], loss_fn: str, *, vocab_size: int | None,
                    max_tokens: int) -> list[TrainSequence]:
    """The trainer's sequences of `data` for `loss_fn` (checked by `loss_config` first)."""
    if not data:
        raise InvalidRequest("forward_backward needs at least one datum", param="data", code="invalid_batch")
    return [_sequence(datum, i, LOSS_INPUTS[loss_fn], vocab_size, max_tokens) for i, datum in enumerate(data)]


def _sequence(datum: WireDatum, index: int, needs: tuple[str, ...], vocab_size: int | None,
              max_tokens: int) -> TrainSequence:
    where = f"data[{index}]"
    inputs = datum.loss_fn_inputs
    missing = [key for key in needs if key not in inputs]
    if missing:
        raise InvalidRequest(f"{where}.loss_fn_inputs lacks {missing} (given: {sorted(inputs)})",
                             param=f"{where}.loss_fn_inputs", code="invalid_batch")
    tokens = list(datum.tokens)
    n = len(tokens)
    if n == 0:
        raise InvalidRequest(f"{where}.model_input is empty", param=f"{where}.model_input", code="invalid_batch")
    arrays = {key: _vector(inputs[key], key, n, where) for key in needs}
    targets = [int(t) for t in arrays["target_tokens"]]
    if targets[:-1] != tokens[1:]:
        raise InvalidRequest(f"{where}: target_tokens must be model_input shifted by one token (this server "
                             "trains a sequence's next-token targets)", param=f"{where}.loss_fn_inputs.target_tokens",
                             code="invalid_batch")
    if n + 1 > max_tokens:
        raise InvalidRequest(f"{where} has {n + 1} tokens, over this server's limit of {max_tokens}",
                             param=where, code="sequence_too_long")
    if vocab_size is not None and not all(0 <= t < vocab_size for t in (*tokens, targets[-1])):
        raise InvalidRequest(f"{where} has a token id outside the vocabulary (0..{vocab_size - 1})", param=where,
                             code="invalid_batch")
    coefficients = arrays["weights"] if "weights" in arrays else arrays["advantages"]
    given = arrays["logprobs"] if "logprobs" in arrays else np.full(n, np.nan)
    # A target with coefficient 0 (a prompt token) was not sampled: its "sampling logprob" (0 by the
    # cookbook's convention) is unknown, so it skews no ratio statistic and adds no dro penalty.
    sampled = [UNKNOWN_LOGPROB if c == 0 or math.isnan(v) else float(v) for v, c in zip(given, coefficients, strict=True)]
    return TrainSequence(token_ids=[*tokens, targets[-1]], trainable=[False] + [True] * n,
                         behaviour_logprobs=[0.0, *sampled], advantage=0.0,
                         token_advantages=[0.0, *(float(v) for v in coefficients)])


def _vector(array: np.ndarray, key: str, n: int, where: str) -> np.ndarray:
    if array.ndim != 1 or array.shape[0] != n:
        raise InvalidRequest(f"{where}.loss_fn_inputs.{key} has shape {list(array.shape)}; expected [{n}] (one row "
                             "per model_input token)", param=f"{where}.loss_fn_inputs.{key}", code="invalid_batch")
    if key != "logprobs" and array.dtype.kind == "f" and not np.isfinite(array).all():
        raise InvalidRequest(f"{where}.loss_fn_inputs.{key} holds NaN or infinity", param=f"{where}.loss_fn_inputs.{key}",
                             code="invalid_batch")
    return array
