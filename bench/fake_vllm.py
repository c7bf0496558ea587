"""A fast fake vLLM OpenAI server: what the artlike proxy needs of an engine, and nothing that costs time.

    python -m bench.fake_vllm --port P [--api-key K] [--delay-ms D] [--tokens N] [--name NAME] [--model ID]

One process, aiohttp, orjson. It answers in vLLM 0.32's shapes (`vllm/entrypoints/openai/*/protocol.py`, and
the shapes `tests/unit/openai_fakes.py` captured from the real server) closely enough for `artlike serve
--engine-url` to serve and record through it:

    GET  /health                    200, no key needed (as vLLM)
    GET  /v1/models                 the base model and every loaded LoRA adapter (`root` = its path,
                                    `parent` = the base model), like vLLM's `show_available_models`
    POST /v1/load_lora_adapter      {"lora_name", "lora_path"}: 200 "Success: ..." (text), 400 if loaded
    POST /v1/unload_lora_adapter    {"lora_name"}: 200, 404 if not loaded
    POST /v1/chat/completions       non-streaming and SSE; `n`, `max_tokens` / `max_completion_tokens`,
    POST /v1/completions            `ignore_eos`, `logprobs` / `top_logprobs`, `prompt_logprobs`,
                                    `return_token_ids`, `stream_options.include_usage`, `model` (404 unknown)
    POST /tokenize                  {"prompt"} or {"messages"}: {"count", "max_model_len", "tokens"}
    GET  /metrics                   a few of vLLM's gauges (`vllm:num_requests_running`, ...), Prometheus text
    GET  /fake/stats                this fake's own counters: {"name", "requests": {path: count}, "running"}

Tokens are fake but consistent: a text's ids are its UTF-8 bytes + 3 (0-2 are reserved: 1 `<|im_start|>`,
2 `<|im_end|>`, the EOS of SmolLM2's ChatML, as in vLLM's answers), so every id is inside a 49k vocabulary and
decodes back. A chat prompt is rendered ChatML-style before it is "tokenized". The answer is a fixed text
(`--tokens` tokens, shifted per choice so that choices differ); unless `ignore_eos` is set or `max_tokens`
cuts it first (finish_reason "length"), its last token is the EOS (id 2, in `token_ids` and `logprobs`, not in
the text; finish_reason "stop"), as vLLM returns it. Logprobs are deterministic per choice and position.
The proxy records what it reads from these fields (`CompletionTrace`) and re-tokenizes nothing.

`--delay-ms` is slept once per request before the first token (generation time, with no CPU spent), so a
fast fake can stand in for a slow engine. Every response carries `x-fake-engine: NAME` and, in completions,
`system_fingerprint: NAME`, so a test can see which engine served a request. With `--api-key K` (or
$VLLM_API_KEY) every route but /health needs `Authorization: Bearer K`: 401 `{"error": "Unauthorized"}`
otherwise, like vLLM's own key middleware.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
IM_START, EOS = 1, 2
_OFFSET = 3  # byte b -> id b + 3
ANSWER = ("The quick brown fox jumps over the lazy dog while the proxy records every token it samples. ")
_JSON = "application/json"


def encode(text: str) -> list[int]:
    return [byte + _OFFSET for byte in text.encode()]


def decode_token(token_id: int) -> str:
    """One id's text: special tokens by name, bytes as the (possibly partial) character they are."""
    if token_id == EOS:
        return "<|im_end|>"
    if token_id == IM_START:
        return "<|im_start|>"
    if _OFFSET <= token_id < _OFFSET + 256:
        return bytes([token_id - _OFFSET]).decode(errors="replace")
    return f"<|{token_id}|>"


def render_chat(messages: list[dict[str, Any]]) -> list[int]:
    """ChatML, as SmolLM2's template renders it, with the generation prompt."""
    ids: list[int] = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        ids += [IM_START, *encode(f"{message.get('role', 'user')}\n{content or ''}"), EOS, *encode("\n")]
    return [*ids, IM_START, *encode("assistant\n")]


def logprob(choice: int, position: int) -> float:
    """Distinct per choice and position; never 0, never positive."""
    return -0.05 * (1 + (position * 7 + choice * 3) % 11)


@dataclass
class Generated:
    """One choice's output: ids, the text they decode to (EOS excluded), finish reason."""

    token_ids: list[int]
    finish_reason: str

    def text(self, upto: int | None = None) -> str:
        ids = self.token_ids if upto is None else self.token_ids[:upto]
        return bytes(i - _OFFSET for i in ids if _OFFSET <= i < _OFFSET + 256).decode(errors="replace")


def generate(choice: int, length: int, max_tokens: int | None, ignore_eos: bool) -> Generated:
    """`length` answer tokens then EOS, cut at `max_tokens`; with `ignore_eos` exactly `max_tokens`."""
    limit = max_tokens if max_tokens is not None else length + 1
    ids = [ord(ANSWER[(choice * 5 + k) % len(ANSWER)]) + _OFFSET for k in range(min(limit, length))]
    if ignore_eos and max_tokens is not None:
        ids += [ord(ANSWER[(choice * 5 + k) % len(ANSWER)]) + _OFFSET for k in range(len(ids), max_tokens)]
        return Generated(ids, "length")
    if len(ids) < limit:
        return Generated([*ids, EOS], "stop")
    return Generated(ids, "length")


@dataclass
class Config:
    name: str
    model: str = DEFAULT_MODEL
    api_key: str | None = None
    delay_s: float = 0.0
    tokens: int = 16
    max_model_len: int = 4096


@dataclass
class State:
    config: Config
    adapters: dict[str, str] = field(default_factory=dict)  # lora_name -> lora_path
    requests: Counter[str] = field(default_factory=Counter)
    running: int = 0
    created: int = field(default_factory=lambda: int(time.time()))


def error(status: int, message: str, kind: str, param: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return web.Response(status=status, body=orjson.dumps(body), content_type=_JSON)


# ----------------------------------------------------------------------------------------- answers


def _chat_logprobs(ids: list[int], choice: int, start: int, top: int) -> dict[str, Any]:
    content = []
    for position, token_id in enumerate(ids, start):
        token = decode_token(token_id)
        value = logprob(choice, position)
        entry: dict[str, Any] = {"token": token, "logprob": value, "bytes": list(token.encode())}
        alternatives = [{"token": token, "logprob": value, "bytes": list(token.encode())}]
        for rank in range(1, top):
            other = decode_token(_OFFSET + (token_id + rank) % 256)
            alternatives.append({"token": other, "logprob": value - rank, "bytes": list(other.encode())})
        entry["top_logprobs"] = alternatives[:top]
        content.append(entry)
    return {"content": content}


def _completion_logprobs(ids: list[int], choice: int, start: int, top: int, offset: int) -> dict[str, Any]:
    tokens = [decode_token(token_id) for token_id in ids]
    values = [logprob(choice, position) for position in range(start, start + len(ids))]
    offsets, top_entries = [], []
    for token, value in zip(tokens, values, strict=True):
        offsets.append(offset)
        offset += len(token)
        entry = {token: value}
        for rank in range(1, top + 1):
            entry.setdefault(f"{token}~{rank}", value - rank)
        top_entries.append(entry)
    return {"text_offset": offsets, "token_logprobs": values, "tokens": tokens, "top_logprobs": top_entries}


def _prompt_logprobs(prompt: list[int], top: int) -> list[dict[str, Any] | None]:
    """vLLM's shape: None for the first token, then {str(id): {logprob, rank, decoded_token}}."""
    result: list[dict[str, Any] | None] = [None]
    for position, token_id in enumerate(prompt[1:], 1):
        entry = {str(token_id): {"logprob": -0.1 * (1 + position % 5), "rank": 1,
                                 "decoded_token": decode_token(token_id)}}
        for rank in range(1, max(top, 0) + 1):
            other = _OFFSET + (token_id + rank) % 256
            entry.setdefault(str(other), {"logprob": -1.0 - rank, "rank": rank + 1,
                                          "decoded_token": decode_token(other)})
        result.append(entry)
    return result


@dataclass
class Request:
    """What one completion request asks for, read the way vLLM reads it."""

    chat: bool
    body: dict[str, Any]
    model: str
    prompts: list[list[int]]
    n: int
    max_tokens: int | None
    ignore_eos: bool
    want_ids: bool
    logprobs: bool
    top: int  # chat: top_logprobs; completions: the logprobs value
    prompt_logprobs: int | None
    stream: bool
    usage: bool


def parse(body: dict[str, Any], chat: bool, max_model_len: int) -> Request | web.Response:
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return error(400, "messages: field required", "BadRequestError", "messages")
        prompts = [render_chat(messages)]
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        logprobs = bool(body.get("logprobs"))
        top = int(body.get("top_logprobs") or 0)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompts = [encode(prompt)]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
            prompts = [list(prompt)]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            prompts = [encode(p) for p in prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
            prompts = [list(p) for p in prompt]
        else:
            return error(400, "prompt: a string, a list of strings or token ids", "BadRequestError", "prompt")
        max_tokens = body.get("max_tokens", 16)  # the completions API's default
        logprobs = body.get("logprobs") is not None
        top = int(body.get("logprobs") or 0)
    if top < 0:
        top = 20
    if any(len(p) >= max_model_len for p in prompts):
        return error(400, f"This model's maximum context length is {max_model_len} tokens.", "BadRequestError")
    prompt_logprobs = body.get("prompt_logprobs")
    return Request(
        chat=chat, body=body, model=str(body.get("model")), prompts=prompts, n=int(body.get("n") or 1),
        max_tokens=max_tokens, ignore_eos=bool(body.get("ignore_eos")), want_ids=bool(body.get("return_token_ids")),
        logprobs=logprobs, top=top, prompt_logprobs=None if prompt_logprobs is None else int(prompt_logprobs),
        stream=bool(body.get("stream")), usage=bool((body.get("stream_options") or {}).get("include_usage")),
    )


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": None}


def full_response(req: Request, config: Config, request_id: str, tokens: int) -> dict[str, Any]:
    choices: list[dict[str, Any]] = []
    completion_tokens = 0
    for prompt_index, prompt in enumerate(req.prompts):
        for sample in range(req.n):
            index = prompt_index * req.n + sample
            out = generate(index, tokens, req.max_tokens, req.ignore_eos)
            completion_tokens += len(out.token_ids)
            choice: dict[str, Any] = {"index": index}
            if req.chat:
                choice["message"] = {"role": "assistant", "content": out.text(), "refusal": None,
                                     "annotations": None, "audio": None, "function_call": None,
                                     "tool_calls": [], "reasoning": None}
                choice["logprobs"] = _chat_logprobs(out.token_ids, index, 0, req.top) if req.logprobs else None
            else:
                choice["text"] = out.text()
                choice["logprobs"] = (_completion_logprobs(out.token_ids, index, 0, req.top, 0)
                                      if req.logprobs else None)
            choice["finish_reason"] = out.finish_reason
            choice["stop_reason"] = None
            choice["token_ids"] = out.token_ids if req.want_ids else None
            if not req.chat:
                choice["prompt_logprobs"] = (_prompt_logprobs(prompt, req.prompt_logprobs)
                                             if req.prompt_logprobs is not None else None)
                choice["prompt_token_ids"] = prompt if req.want_ids else None
            choice["routed_experts"] = None
            choices.append(choice)
    response: dict[str, Any] = {
        "id": request_id, "object": "chat.completion" if req.chat else "text_completion",
        "created": int(time.time()), "model": req.model, "choices": choices, "service_tier": None,
        "system_fingerprint": config.name,
        "usage": _usage(sum(len(p) for p in req.prompts), completion_tokens),
    }
    if req.chat:
        prompt = req.prompts[0]
        response["prompt_logprobs"] = (_prompt_logprobs(prompt, req.prompt_logprobs)
                                       if req.prompt_logprobs is not None else None)
        response["prompt_token_ids"] = prompt if req.want_ids else None
        response["prompt_text"] = None
    response["kv_transfer_params"] = None
    response["ec_transfer_params"] = None
    response["metrics"] = None
    return response


def stream_events(req: Request, config: Config, request_id: str, tokens: int) -> list[bytes]:
    """The whole SSE body, event by event (vLLM dumps chunks with `exclude_unset`: only set fields)."""
    created = int(time.time())
    base = {"id": request_id, "object": "chat.completion.chunk" if req.chat else "text_completion",
            "created": created, "model": req.model}
    events: list[dict[str, Any]] = []
    outputs: list[tuple[int, list[int], Generated]] = []
    for prompt_index, prompt in enumerate(req.prompts):
        for sample in range(req.n):
            index = prompt_index * req.n + sample
            outputs.append((index, prompt, generate(index, tokens, req.max_tokens, req.ignore_eos)))
    if req.chat:
        for index, prompt, _ in outputs:  # the role chunk, first for each choice; prompt ids ride on it
            events.append({**base, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}],
                           "prompt_token_ids": prompt if req.want_ids else None, "prompt_text": None})
    longest = max((len(out.token_ids) for _, _, out in outputs), default=0)
    text_offsets = {index: 0 for index, _, _ in outputs}
    for position in range(longest):
        for index, prompt, out in outputs:
            if position >= len(out.token_ids):
                continue
            token_id = out.token_ids[position]
            last = position == len(out.token_ids) - 1
            text = "" if token_id == EOS else decode_token(token_id)
            choice: dict[str, Any] = {"index": index}
            if req.chat:
                choice["delta"] = {"content": text} if text else {}
                choice["logprobs"] = _chat_logprobs([token_id], index, position, req.top) if req.logprobs else None
            else:
                choice["text"] = text
                choice["logprobs"] = (_completion_logprobs([token_id], index, position, req.top,
                                                           text_offsets[index]) if req.logprobs else None)
                text_offsets[index] += len(text)
                choice["prompt_token_ids"] = prompt if req.want_ids and position == 0 else None
            choice["finish_reason"] = out.finish_reason if last else None
            if last or not req.chat:
                choice["stop_reason"] = None
            choice["token_ids"] = [token_id] if req.want_ids else None
            chunk = {**base, "choices": [choice]}
            if last and not req.usage:
                chunk["system_fingerprint"] = config.name
            events.append(chunk)
    if req.usage:
        completion_tokens = sum(len(out.token_ids) for _, _, out in outputs)
        events.append({**base, "choices": [], "system_fingerprint": config.name,
                       "usage": _usage(sum(len(p) for p in req.prompts), completion_tokens)})
    return [b"data: " + orjson.dumps(event) + b"\n\n" for event in events] + [b"data: [DONE]\n\n"]


# ----------------------------------------------------------------------------------------- server


def build_app(config: Config) -> web.Application:
    state = State(config)
    headers = {"x-fake-engine": config.name}
    expected = f"Bearer {config.api_key}" if config.api_key else None

    @web.middleware
    async def guard(request: web.Request, handler: Any) -> web.StreamResponse:
        state.requests[request.path] += 1
        if expected is not None and request.path != "/health" and request.headers.get("Authorization") != expected:
            response: web.StreamResponse = web.Response(status=401, body=b'{"error":"Unauthorized"}',
                                                        content_type=_JSON)
        else:
            response = await handler(request)
        if not response.prepared:
            response.headers.update(headers)
        return response

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(request: web.Request) -> web.Response:
        def card(model_id: str, root: str, parent: str | None) -> dict[str, Any]:
            return {"id": model_id, "object": "model", "created": state.created, "owned_by": "vllm", "root": root,
                    "parent": parent, "max_model_len": config.max_model_len if parent is None else None,
                    "permission": [{"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission",
                                    "created": state.created, "allow_create_engine": False,
                                    "allow_sampling": True, "allow_logprobs": True,
                                    "allow_search_indices": False, "allow_view": True,
                                    "allow_fine_tuning": False, "organization": "*", "group": None,
                                    "is_blocking": False}]}

        data = [card(config.model, config.model, None)]
        data += [card(name, path, config.model) for name, path in state.adapters.items()]
        return web.Response(body=orjson.dumps({"object": "list", "data": data}), content_type=_JSON)

    async def read_json(request: web.Request) -> dict[str, Any] | web.Response:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            return error(400, "the body is not valid JSON", "BadRequestError")
        if not isinstance(body, dict):
            return error(400, "the body must be a JSON object", "BadRequestError")
        return body

    async def load_adapter(request: web.Request) -> web.Response:
        body = await read_json(request)
        if isinstance(body, web.Response):
            return body
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            return error(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        if name == config.model:
            return error(400, f"The lora adapter '{name}' conflicts with a served base model.", "InvalidUserInput")
        if name in state.adapters and not body.get("load_inplace"):
            return error(400, f"The lora adapter '{name}' has already been loaded. If you want to load the "
                         "adapter in place, set 'load_inplace' to True.", "InvalidUserInput")
        state.adapters[name] = str(path)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_adapter(request: web.Request) -> web.Response:
        body = await read_json(request)
        if isinstance(body, web.Response):
            return body
        name = body.get("lora_name")
        if not name:
            return error(400, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput")
        if state.adapters.pop(name, None) is None:
            return error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        if isinstance(body, web.Response):
            return body
        chat = request.path == "/v1/chat/completions"
        model = body.get("model") or config.model
        if model != config.model and model not in state.adapters:
            return error(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        body["model"] = model
        req = parse(body, chat, config.max_model_len)
        if isinstance(req, web.Response):
            return req
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        state.running += 1
        try:
            if config.delay_s > 0:
                await asyncio.sleep(config.delay_s)
            if not req.stream:
                payload = full_response(req, config, request_id, config.tokens)
                return web.Response(body=orjson.dumps(payload), content_type=_JSON, headers=headers)
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", **headers})
            await response.prepare(request)
            for event in stream_events(req, config, request_id, config.tokens):
                await response.write(event)
            await response.write_eof()
            return response
        finally:
            state.running -= 1

    async def tokenize(request: web.Request) -> web.Response:
        body = await read_json(request)
        if isinstance(body, web.Response):
            return body
        if "messages" in body:
            tokens = render_chat(body["messages"])
        else:
            prompt = body.get("prompt", "")
            tokens = encode(prompt) if isinstance(prompt, str) else list(prompt)
        return web.Response(body=orjson.dumps({"count": len(tokens), "max_model_len": config.max_model_len,
                                               "tokens": tokens, "token_strs": None}), content_type=_JSON)

    async def metrics(request: web.Request) -> web.Response:
        lines = [
            "# TYPE vllm:num_requests_running gauge",
            f'vllm:num_requests_running{{model_name="{config.model}"}} {state.running}',
            "# TYPE vllm:num_requests_waiting gauge",
            f'vllm:num_requests_waiting{{model_name="{config.model}"}} 0',
        ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def stats(request: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps({"name": config.name, "requests": dict(state.requests),
                                               "running": state.running, "adapters": state.adapters}),
                            content_type=_JSON)

    app = web.Application(middlewares=[guard], client_max_size=64 * 1024 * 1024)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/load_lora_adapter", load_adapter)
    app.router.add_post("/v1/unload_lora_adapter", unload_adapter)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/fake/stats", stats)
    app["state"] = state
    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY") or None,
                        help="require `Authorization: Bearer KEY` on every route but /health (default: $VLLM_API_KEY)")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="slept once per completion request")
    parser.add_argument("--tokens", type=int, default=16, help="answer length before EOS (max_tokens cuts it)")
    parser.add_argument("--name", default=None, help="echoed in x-fake-engine and system_fingerprint "
                        "(default: fake-PORT)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the base model's id (the proxy's served name)")
    parser.add_argument("--max-model-len", type=int, default=4096)
    args = parser.parse_args(argv)
    config = Config(name=args.name or f"fake-{args.port}", model=args.model, api_key=args.api_key,
                    delay_s=args.delay_ms / 1000, tokens=args.tokens, max_model_len=args.max_model_len)
    try:
        import uvloop  # optional: a faster event loop where installed
    except ImportError:
        uvloop = None  # type: ignore[assignment]
    print(f"fake vLLM {config.name} on http://{args.host}:{args.port} (model {config.model})", flush=True)
    web.run_app(build_app(config), host=args.host, port=args.port, access_log=None, print=None,
                loop=uvloop.new_event_loop() if uvloop is not None else None)


if __name__ == "__main__":
    main()
