"""Tinker's `sample` and `compute_logprobs` as completions of the engine, through the proxy's own path.

A sample request becomes a `/v1/completions` request on token ids for the sampler's served model
(`name@N`, or the base model), recorded under a trajectory id like any other completion: the tokens and
logprobs a Tinker client gets back are the engine's, and the completion log holds them.

Stops as Tinker defines them: no `stop` keeps the model's end-of-sequence token; token ids stop on those
tokens, strings on those strings (kept in the output, as the cookbook's parsers expect); an empty list
disables every stop, the end-of-sequence token included.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from ..errors import InvalidRequest
from ..openai_api.serving import OpenAIServing
from .requests import SampleBody
from .wire import SampledOutput


def prompt_tokens(body: SampleBody) -> list[int]:
    tokens: list[int] = []
    for index, chunk in enumerate(body.prompt.chunks):
        if chunk.type != "encoded_text":
            raise InvalidRequest(f"prompt.chunks[{index}] is {chunk.type!r}: this server samples text models "
                                 "(encoded_text chunks only)", param=f"prompt.chunks[{index}]",
                                 code="unsupported_chunk")
        tokens.extend(chunk.tokens)
    if not tokens:
        raise InvalidRequest("the prompt has no tokens", param="prompt", code="invalid_value")
    return tokens


def completion_body(body: SampleBody, model: str, prompt: Sequence[int]) -> dict[str, Any]:
    if body.topk_prompt_logprobs or body.topk_sample_logprobs:
        raise InvalidRequest("top-k logprobs are not served by this server's Tinker API",
                             param="topk_sample_logprobs", code="unsupported_parameter")
    params = body.sampling_params
    request: dict[str, Any] = {"model": model, "prompt": list(prompt), "n": body.num_samples,
                               "temperature": params.temperature, "top_p": params.top_p, "logprobs": 0,
                               "return_token_ids": True}
    if params.max_tokens is not None:
        request["max_tokens"] = params.max_tokens
    if params.top_k > 0:
        request["top_k"] = params.top_k
    if params.seed is not None:
        request["seed"] = params.seed
    stop = params.stop
    if isinstance(stop, str):
        stop = [stop]
    if stop == []:
        request["ignore_eos"] = True
    elif stop and all(isinstance(s, int) for s in stop):
        request["stop_token_ids"] = list(stop)
    elif stop:
        request["stop"] = list(stop)
        request["include_stop_str_in_output"] = True
    if body.prompt_logprobs:
        request["prompt_logprobs"] = 0
    return request


async def sample(serving: OpenAIServing, body: SampleBody, model: str, trajectory_id: str
                 ) -> tuple[list[SampledOutput], list[float | None] | None]:
    """The samples (tokens, logprobs, stop reason) and, when asked, the prompt's logprobs (None first)."""
    prompt = prompt_tokens(body)
    raw = orjson.dumps(completion_body(body, model, prompt))
    answer = await serving.create_completion("completions", raw, trajectory_id)
    assert isinstance(answer, bytes), "a request without `stream` is answered whole"
    payload = orjson.loads(answer)
    choices = sorted(payload["choices"], key=lambda choice: int(choice["index"]))
    outputs = [SampledOutput(tokens=[int(t) for t in choice["token_ids"]],
                             logprobs=[float(v) for v in choice["logprobs"]["token_logprobs"]],
                             stop_reason="length" if choice.get("finish_reason") == "length" else "stop")
               for choice in choices]
    prompt_logprobs = _prompt_logprobs(payload, prompt) if body.prompt_logprobs else None
    return outputs, prompt_logprobs


def _prompt_logprobs(payload: dict[str, Any], prompt: Sequence[int]) -> list[float | None]:
    """vLLM's per-position {token id: {logprob}} as the logprob of each prompt token (None for the first)."""
    positions = payload.get("prompt_logprobs")
    if positions is None:
        positions = (payload["choices"][0] or {}).get("prompt_logprobs")
    values: list[float | None] = [None]
    for token, position in zip(prompt[1:], (positions or [])[1:], strict=False):
        entry = (position or {}).get(str(token))
        values.append(None if entry is None else float(entry["logprob"]))
    values.extend([None] * (len(prompt) - len(values)))
    return values
