"""Rewriting between the caller and vLLM: the body sent upstream and the answer sent back.

Upstream, the caller's body gets the served engine name and what the proxy needs (`prepare_upstream_body`):
on trajectory URLs `logprobs` and `return_token_ids` (and `include_reasoning`, whose absence hides token
ids); on every stream `stream_options.include_usage`. Back, vLLM's JSON is rewritten in place
(`rewrite_response` / `rewrite_chunk`), never re-validated: what the proxy forced and the caller did not
ask for is removed, vLLM-only fields are dropped when null, stream chunks left empty are dropped, and
`model` is the exact served name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from artlike_server.openai_api.protocol import Endpoint

# vLLM-only response fields dropped when they are null (noise for an OpenAI client); the proxy-forced ones
# (token ids, logprobs) are handled by `_strip_*` according to what the caller asked for.
_NULL_EXTRAS_TOP = ("prompt_logprobs", "prompt_text", "kv_transfer_params", "ec_transfer_params", "metrics")
_NULL_EXTRAS_CHOICE = ("stop_reason", "routed_experts", "prompt_logprobs")
# vLLM sends these as null; the OpenAI schema allows them absent, not null (array / object).
_NULL_NOT_ALLOWED_MESSAGE = ("annotations", "function_call")
_NULL_NOT_ALLOWED_USAGE = ("completion_tokens_details", "prompt_tokens_details")


@dataclass(frozen=True, slots=True)
class CallerAsked:
    """Which of the fields the proxy may force into a response the caller asked for itself."""

    logprobs: bool = False
    token_ids: bool = False
    prompt_logprobs: bool = False
    prompt_text: bool = False
    reasoning: bool = True
    usage: bool = False


def prepare_upstream_body(
    endpoint: Endpoint, body: dict[str, Any], engine_name: str, *, record: bool
) -> tuple[dict[str, Any], CallerAsked]:
    """The body to send to vLLM, and what the caller asked for (to strip the rest from the answer).

    >>> prepare_upstream_body("chat.completions", {"model": "m", "messages": []}, "m@3", record=True)[0]
    {'model': 'm@3', 'messages': [], 'return_token_ids': True, 'logprobs': True}
    """
    stream_options = body.get("stream_options") or {}
    asked = CallerAsked(
        logprobs=bool(body.get("logprobs"))
        if endpoint == "chat.completions"
        else body.get("logprobs") is not None,
        token_ids=bool(body.get("return_token_ids")),
        prompt_logprobs=body.get("prompt_logprobs") is not None,
        prompt_text=bool(body.get("return_prompt_text")),
        reasoning=body.get("include_reasoning") is not False,
        usage=bool(stream_options.get("include_usage")),
    )
    upstream = dict(body)
    upstream["model"] = engine_name
    if body.get("stream"):
        upstream["stream_options"] = {**stream_options, "include_usage": True}
    if record:
        upstream["return_token_ids"] = True
        if endpoint == "chat.completions":
            upstream["logprobs"] = True
            if not asked.reasoning:
                upstream["include_reasoning"] = True  # vLLM hides token ids along with the reasoning
        elif not asked.logprobs:
            upstream["logprobs"] = 0  # completions: the sampled token's logprob, no alternatives
    return upstream, asked


# ------------------------------------------------------------------------------- response rewriting


def _strip_top(payload: dict[str, Any], asked: CallerAsked) -> None:
    for key in _NULL_EXTRAS_TOP:
        if key in payload and payload[key] is None:
            del payload[key]
    if not asked.token_ids:
        payload.pop("prompt_token_ids", None)
    if not asked.prompt_logprobs:
        payload.pop("prompt_logprobs", None)
    if not asked.prompt_text:
        payload.pop("prompt_text", None)


def _strip_choice(choice: dict[str, Any], asked: CallerAsked) -> None:
    for key in _NULL_EXTRAS_CHOICE:
        if key in choice and choice[key] is None:
            del choice[key]
    if not asked.token_ids:
        choice.pop("token_ids", None)
        choice.pop("prompt_token_ids", None)
    elif "prompt_token_ids" in choice and choice["prompt_token_ids"] is None:
        del choice["prompt_token_ids"]
    if not asked.prompt_logprobs:
        choice.pop("prompt_logprobs", None)
    if not asked.logprobs and "logprobs" in choice:
        choice["logprobs"] = None
    message = choice.get("message") or choice.get("delta")
    logprobs = choice.get("logprobs")
    is_chat = "message" in choice or "delta" in choice
    if is_chat and isinstance(logprobs, dict) and "refusal" not in logprobs:
        logprobs["refusal"] = None  # the OpenAI schema requires it in a chat choice's logprobs (null: none)
    if message and "reasoning" in message and (message["reasoning"] is None or not asked.reasoning):
        del message["reasoning"]


def rewrite_response(payload: dict[str, Any], asked: CallerAsked, served_name: str) -> None:
    """Rewrite a non-streaming vLLM response in place for the caller."""
    payload["model"] = served_name
    _strip_top(payload, asked)
    _drop_nulls(payload.get("usage"), _NULL_NOT_ALLOWED_USAGE)
    for choice in payload.get("choices") or ():
        _strip_choice(choice, asked)
        _drop_nulls(choice.get("message"), _NULL_NOT_ALLOWED_MESSAGE)


def _drop_nulls(part: Any, keys: tuple[str, ...]) -> None:
    if isinstance(part, dict):
        for key in keys:
            if key in part and part[key] is None:
                del part[key]


def _says_nothing(choice: dict[str, Any]) -> bool:
    """A chunk choice that only carried forced fields: vLLM would not have sent it."""
    if choice.get("finish_reason") is not None or choice.get("logprobs") is not None:
        return False
    if "delta" in choice:
        return not choice["delta"]
    return not choice.get("text")


def rewrite_chunk(chunk: dict[str, Any], asked: CallerAsked, served_name: str) -> bool:
    """Rewrite one stream chunk in place; False when nothing is left for the caller (drop the event)."""
    choices = chunk.get("choices")
    if choices is None:
        return True  # an in-stream error event: passed through as vLLM sent it
    chunk["model"] = served_name
    _strip_top(chunk, asked)
    if not asked.usage:
        if not choices:
            return False  # the forced usage-only chunk
        chunk.pop("usage", None)
    if not choices:
        return True
    for choice in choices:
        _strip_choice(choice, asked)
    kept = [choice for choice in choices if not _says_nothing(choice)]
    if len(kept) != len(choices):
        chunk["choices"] = kept
    return bool(kept) or "usage" in chunk
