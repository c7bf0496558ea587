"""Stand-ins for the app's shared objects, to run the OpenAI routers without `artlike serve`.

`build_app` builds the real app (`create_app`) over fake services: the real completion log and metrics, an `Upstream` client
that talks to whatever plays the engine: a real vLLM or `FakeVLLM` (an aiohttp server in the test's event
loop), which answers in vLLM 0.32's response shapes (captured from the real server) and fails on demand.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from artlike_server.app import create_app
from artlike_server.completion_log import CompletionLog
from artlike_server.engine.upstream import Upstream
from artlike_server.errors import NotFound
from artlike_server.metrics import Metrics
from artlike_server.openai_api.policy import RequestPolicy
from artlike_server.openai_api.serving import OpenAIServing
from artlike_server.settings import NetworkSettings
from fastapi import FastAPI

from tests.unit.fake_services import fake_services


@dataclass
class FakeEngine:
    state: str = "ready"
    restarts: int = 0
    retry_seconds: float = 7.0

    def retry_after(self) -> float:
        return self.retry_seconds


class EngineWithUpstream:
    """The engine as the routes see it (`state.engine`, the pool in the real app): the fake's state, the real
    `Upstream`'s POSTs to the fake vLLM."""

    def __init__(self, engine: FakeEngine, upstream: Upstream) -> None:
        self._engine = engine
        self._upstream = upstream

    @property
    def state(self) -> str:
        return self._engine.state

    @property
    def restarts(self) -> int:
        return self._engine.restarts

    def retry_after(self) -> float:
        return self._engine.retry_after()

    async def post(self, path: str, body: bytes, *, affinity: str | None = None, replayable: bool = False,
                   model: str | None = None) -> Any:
        return await self._upstream.post(path, body, affinity=affinity, replayable=replayable, model=model)


@dataclass(frozen=True)
class ServedModel:
    engine_name: str
    model: str | None
    step: int | None


@dataclass
class FakeModels:
    """Serves the base model and trainable models `{name: latest_step}`, all steps 0..latest."""

    base_model: str
    trainable: dict[str, int] = field(default_factory=dict)
    leased: list[str] = field(default_factory=list)  # engine names currently leased

    def resolve(self, requested: str) -> ServedModel:
        if requested == self.base_model:
            return ServedModel(self.base_model, None, None)
        name, _, step_text = requested.partition("@")
        latest = self.trainable.get(name)
        if latest is None:
            raise NotFound(f"model {requested!r} does not exist", param="model", code="model_not_found")
        step = int(step_text) if step_text.isdigit() else latest if not step_text else -1
        if not 0 <= step <= latest:
            raise NotFound(f"model {name!r} has no step {step_text}", param="model", code="model_not_found")
        return ServedModel(f"{name}@{step}", name, step)

    @asynccontextmanager
    async def lease(self, requested: str) -> AsyncIterator[ServedModel]:
        served = self.resolve(requested)
        self.leased.append(served.engine_name)
        try:
            yield served
        finally:
            self.leased.remove(served.engine_name)

    async def served_model_ids(self) -> list[str]:
        ids = [self.base_model]
        for name, latest in sorted(self.trainable.items()):
            ids.append(name)
            ids.extend(f"{name}@{step}" for step in range(latest + 1))
        return ids


@dataclass(frozen=True)
class Settings:
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    reject_seed: bool = False
    max_recorded_choices: int = 16
    max_request_tokens: int = 16 * 4096 * 21
    max_model_len: int | None = 4096


def build_app(
    upstream: Upstream,
    log: CompletionLog,
    *,
    models: FakeModels,
    engine: FakeEngine | None = None,
    settings: Settings | None = None,
    metrics: Metrics | None = None,
) -> FastAPI:
    settings = settings or Settings()
    metrics = metrics or Metrics()
    engine = engine or FakeEngine()
    metrics.track_engine(engine)
    metrics.track_completion_log(log)
    with_upstream = EngineWithUpstream(engine, upstream)
    requests = RequestPolicy(reject_seed=settings.reject_seed, max_recorded_choices=settings.max_recorded_choices,
                             max_request_tokens=settings.max_request_tokens, max_model_len=settings.max_model_len)
    return create_app(fake_services(
        engine=with_upstream,
        models=models,
        log=log,
        metrics=metrics,
        network=NetworkSettings(api_key=settings.api_key),
        max_body_bytes=settings.max_body_bytes,
        requests=requests,
        serving=OpenAIServing(engine=with_upstream, upstream=with_upstream, models=models, log=log,  # type: ignore[arg-type]
                              metrics=metrics, settings=requests),
    ))


# ------------------------------------------------------------------------------------------ fake vLLM

PROMPT_IDS = [1, 9690, 198, 4093]
TOKENS = [(504, "The"), (2988, " answer"), (314, " is"), (216, " "), (36, "4"), (2, "<|im_end|>")]
TEXT = "The answer is 4"  # the EOS token is sampled (in token_ids and logprobs) but not in the text


def fake_logprob(choice: int, position: int) -> float:
    """Distinct per choice and position, so a logprob recorded against the wrong token shows up."""
    return -(position + 1) / (4 * (choice + 1))


class FakeVLLM:
    """Plays vLLM's OpenAI server for chat completions and completions, over real HTTP on a loopback port
    (aiohttp), so the proxy's real `Upstream` client talks to it; records what it was sent.

    `start()` before use (in the test's event loop), `stop()` after. Failure modes, set at any time:
    `disconnect` (close the connection without answering), `error` (answer this status and body),
    `stall_after_events` (a slow engine: keep the stream open until the client goes; 0 also stalls a
    non-streamed answer), `break_after_events` (close the connection mid-stream). `closed_streams` counts
    the answers whose client went away before they ended: what makes vLLM abort a generation.
    """

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.disconnect = False
        self.error: tuple[int, bytes] | None = None  # (status, body) answered instead of a completion
        self.stall_after_events: int | None = None
        self.break_after_events: int | None = None
        self.stalled = asyncio.Event()
        self.closed_streams = 0
        self.stream_closed = asyncio.Event()  # set at each client hang-up
        self._runner: web.AppRunner | None = None
        self.base_url = ""

    async def start(self) -> Upstream:
        """Listen on a free loopback port; returns an `Upstream` client for it."""
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.handle)
        app.router.add_post("/v1/completions", self.handle)
        # handler_cancellation: a client that hangs up cancels the handler, as in vLLM (which then aborts)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.base_url = f"http://127.0.0.1:{port}"
        return Upstream(self.base_url)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if self.disconnect:
            assert request.transport is not None
            request.transport.close()
            return web.Response()  # never sent: the connection is gone
        body = orjson.loads(await request.read())
        self.requests.append(body)
        if self.error is not None:
            status, content = self.error
            return web.Response(status=status, body=content, content_type="application/json")
        chat = request.path == "/v1/chat/completions"
        try:
            if not body.get("stream"):
                if self.stall_after_events == 0:
                    await self._stall()
                return web.Response(body=orjson.dumps(self._response(body, chat)), content_type="application/json")
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            events = [b"data: " + orjson.dumps(chunk) + b"\n\n" for chunk in self._chunks(body, chat)]
            events.append(b"data: [DONE]\n\n")
            for number, event in enumerate(events):
                if number == self.stall_after_events:
                    await self._stall()
                if number == self.break_after_events:
                    assert request.transport is not None
                    request.transport.close()  # the engine died mid-stream
                    return response
                await response.write(event)
                await asyncio.sleep(0)  # one event per network write, as vLLM sends them
            await response.write_eof()
            return response
        except asyncio.CancelledError:
            self.closed_streams += 1
            self.stream_closed.set()
            raise

    async def _stall(self) -> None:
        self.stalled.set()
        await asyncio.Event().wait()  # only the client going away ends this

    @staticmethod
    def _logprob_entry(choice: int, position: int, token: str) -> dict[str, Any]:
        return {
            "token": token,
            "logprob": fake_logprob(choice, position),
            "bytes": list(token.encode()),
            "top_logprobs": [],
        }

    def _response(self, body: dict[str, Any], chat: bool) -> dict[str, Any]:
        ids = [token_id for token_id, _ in TOKENS]
        wants_ids = bool(body.get("return_token_ids"))
        choices = []
        for index in range(body.get("n") or 1):
            logprobs: Any = None
            if chat and body.get("logprobs"):
                logprobs = {"content": [self._logprob_entry(index, k, t) for k, (_, t) in enumerate(TOKENS)]}
            elif not chat and body.get("logprobs") is not None:
                logprobs = {
                    "text_offset": list(range(len(TOKENS))),
                    "token_logprobs": [fake_logprob(index, k) for k in range(len(TOKENS))],
                    "tokens": [t for _, t in TOKENS],
                    "top_logprobs": [{t: fake_logprob(index, k)} for k, (_, t) in enumerate(TOKENS)],
                }
            choice: dict[str, Any] = {
                "index": index,
                "logprobs": logprobs,
                "finish_reason": "stop",
                "stop_reason": None,
            }
            if chat:
                choice["message"] = {
                    "role": "assistant",
                    "content": TEXT,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "reasoning": None,
                }
            else:
                choice["text"] = TEXT
                choice["prompt_logprobs"] = None
                choice["prompt_token_ids"] = PROMPT_IDS if wants_ids else None
            choice["token_ids"] = ids if wants_ids else None
            choice["routed_experts"] = None
            choices.append(choice)
        n_out = len(TOKENS) * len(choices)
        response: dict[str, Any] = {
            "id": "chatcmpl-fake" if chat else "cmpl-fake",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": body["model"],
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": "vllm-fake",
            "usage": {
                "prompt_tokens": len(PROMPT_IDS),
                "total_tokens": len(PROMPT_IDS) + n_out,
                "completion_tokens": n_out,
                "prompt_tokens_details": None,
                "completion_tokens_details": None,
            },
            "prompt_logprobs": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }
        if chat:
            response["prompt_token_ids"] = PROMPT_IDS if wants_ids else None
            response["prompt_text"] = None
        return response

    def _chunks(self, body: dict[str, Any], chat: bool) -> list[dict[str, Any]]:
        wants_ids = bool(body.get("return_token_ids"))
        n = body.get("n") or 1
        base = {
            "id": "chatcmpl-fake" if chat else "cmpl-fake",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": body["model"],
        }
        chunks: list[dict[str, Any]] = []
        if chat:
            for index in range(n):
                first = {
                    **base,
                    "choices": [
                        {
                            "index": index,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                }
                if wants_ids:
                    first["prompt_token_ids"] = PROMPT_IDS
                first["prompt_text"] = None
                chunks.append(first)
        for position, (token_id, token) in enumerate(TOKENS):
            last = position == len(TOKENS) - 1
            for index in range(n):
                choice: dict[str, Any] = {"index": index, "finish_reason": "stop" if last else None}
                if chat:
                    choice["delta"] = {} if token_id == 2 else {"content": token}
                    choice["logprobs"] = (
                        {"content": [self._logprob_entry(index, position, token)]}
                        if body.get("logprobs")
                        else None
                    )
                else:
                    choice["text"] = "" if token_id == 2 else token
                    choice["logprobs"] = (
                        {
                            "text_offset": [position],
                            "token_logprobs": [fake_logprob(index, position)],
                            "tokens": [token],
                            "top_logprobs": [{token: fake_logprob(index, position)}],
                        }
                        if body.get("logprobs") is not None
                        else None
                    )
                    choice["stop_reason"] = None
                    choice["prompt_token_ids"] = PROMPT_IDS if wants_ids and position == 0 else None
                if last:
                    choice["stop_reason"] = None
                if wants_ids:
                    choice["token_ids"] = [token_id]
                chunk = {**base, "choices": [choice]}
                chunks.append(chunk)
        if (body.get("stream_options") or {}).get("include_usage"):
            n_out = len(TOKENS) * n
            chunks.append(
                {
                    **base,
                    "choices": [],
                    "usage": {
                        "prompt_tokens": len(PROMPT_IDS),
                        "total_tokens": len(PROMPT_IDS) + n_out,
                        "completion_tokens": n_out,
                    },
                }
            )
        return chunks
