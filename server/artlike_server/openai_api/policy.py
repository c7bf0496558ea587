"""What one completion request may ask for: the serving layer's limits, from `LimitsSettings` and the engine's."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestPolicy:
    reject_seed: bool = False  # a per-request `seed` answers 400 (where it could crash the engine)
    max_recorded_choices: int = 16  # `n` of one request through a trajectory URL
    max_request_tokens: int = 16 * 4096 * 21  # n x max_tokens x (1 + top_logprobs) of one request
    max_model_len: int | None = 4096  # a request's length when it gives no max_tokens
