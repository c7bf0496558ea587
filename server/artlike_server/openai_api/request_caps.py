"""How much one completion request may ask the engine to send back, checked before the engine is asked.

A non-streamed answer is read whole, and its size is set by the request: every choice of every prompt,
every output token, and for each token its sampled logprob plus `top_logprobs` alternatives. So the
proxy caps the product of

    prompts × max(n, best_of) × max_tokens (the model's length when absent) × (1 + top_logprobs)

plus, when prompt logprobs are asked for (`prompt_logprobs`, or `echo` with `logprobs`), the model's length ×
(1 + their count) per prompt. `-1` (every token of the vocabulary) counts as ALL_TOKENS. Over the cap is a
400 `request_too_large` naming the factor to lower. The same check serves every route and dialect: the
Responses API and Anthropic Messages are checked on the chat body they become, and the blamed field is
named as the caller spelled it.

    >>> entries("chat.completions", {"n": 16, "max_tokens": 4096, "logprobs": True, "top_logprobs": 20},
    ...         max_model_len=4096).total
    1376256
    >>> entries("completions", {"prompt": ["a", "b"], "max_tokens": 10}, max_model_len=4096).total
    20
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidRequest
from .protocol import Endpoint

ALL_TOKENS = 262_144
"""What `top_logprobs: -1` (the whole vocabulary) counts as: at least the vocabulary of the models served."""

DEFAULT_MODEL_LEN = 4096
"""The output length assumed when neither the request nor the server says (an engine run by others)."""

CALLER_FIELDS: dict[str, dict[str, str]] = {"responses": {"max_tokens": "max_output_tokens"}}
"""Chat body fields under the name the caller sent, per dialect."""


@dataclass(frozen=True)
class Entries:
    """The factors of one request's output size, in token entries (a token and each of its logprobs)."""

    prompts: int
    choices: int
    max_tokens: int
    max_tokens_field: str | None  # the field that set max_tokens (None: the model's length)
    logprobs: int  # alternatives per output token
    logprobs_field: str
    prompt_entries: int  # prompt logprobs, all prompts together

    @property
    def total(self) -> int:
        return self.prompts * self.choices * self.max_tokens * (1 + self.logprobs) + self.prompt_entries


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _count(value: int) -> int:
    return ALL_TOKENS if value < 0 else value


def _prompts(endpoint: Endpoint, body: Mapping[str, Any]) -> int:
    prompt = body.get("prompt")
    if endpoint == "completions" and isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return len(prompt)  # a batch of prompts: one set of choices each
    return 1


def entries(endpoint: Endpoint, body: Mapping[str, Any], *, max_model_len: int | None) -> Entries:
    """The output size factors of a validated request body."""
    model_len = max_model_len or DEFAULT_MODEL_LEN
    prompts = _prompts(endpoint, body)
    choices = max(_int(body.get("n"), 1), _int(body.get("best_of"), 1))
    field = next((f for f in ("max_completion_tokens", "max_tokens") if _int(body.get(f), -1) >= 0), None)
    max_tokens = min(_int(body.get(field), model_len), model_len) if field else model_len
    if endpoint == "chat.completions":
        logprobs_field = "top_logprobs"
        logprobs = _count(_int(body.get("top_logprobs"), 0)) if body.get("logprobs") else 0
    else:
        logprobs_field = "logprobs"
        logprobs = _count(_int(body.get("logprobs"), 0))
    prompt_logprobs = _int(body.get("prompt_logprobs"), -2)
    if prompt_logprobs == -2 and endpoint == "completions" and body.get("echo") and body.get("logprobs") is not None:
        prompt_logprobs = logprobs
    prompt_entries = 0 if prompt_logprobs == -2 else prompts * model_len * (1 + _count(prompt_logprobs))
    return Entries(prompts, choices, max_tokens, field, logprobs, logprobs_field, prompt_entries)


def check_request_size(endpoint: Endpoint, body: Mapping[str, Any], *, limit: int, max_model_len: int | None,
                       dialect: str | None = None) -> None:
    """Raise a 400 `request_too_large` when the request may make the engine answer more than `limit` entries."""
    size = entries(endpoint, body, max_model_len=max_model_len)
    if size.total <= limit:
        return
    names = CALLER_FIELDS.get(dialect or "", {})
    tokens_name = names.get(size.max_tokens_field or "max_tokens", size.max_tokens_field or "max_tokens")
    if size.prompt_entries > limit:
        param = "prompt_logprobs" if body.get("prompt_logprobs") is not None else "echo"
    elif size.logprobs > 0:
        param = size.logprobs_field
    elif size.choices > 1:
        param = "best_of" if _int(body.get("best_of"), 1) > _int(body.get("n"), 1) else "n"
    elif size.prompts > 1:
        param = "prompt"
    else:
        param = tokens_name
    tokens = f"{tokens_name}={size.max_tokens}" if size.max_tokens_field else \
        f"{tokens_name} (absent: the model's {size.max_tokens})"
    shown = f"{size.prompts} prompts × " if size.prompts > 1 else ""
    shown += f"n={size.choices} × {tokens} × (1 + {size.logprobs_field}={size.logprobs})"
    if size.prompt_entries:
        shown += f" + {size.prompt_entries:,} prompt logprob entries"
    raise InvalidRequest(
        f"this request may return {size.total:,} token entries ({shown}); this server allows "
        f"{limit:,} per request (--max-request-tokens): lower {names.get(param, param)}, or send several requests",
        param=names.get(param, param), code="request_too_large")
