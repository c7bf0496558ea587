"""The HTTP clients that talk to the vLLM engine, plus typed wrappers for its admin endpoints.

`EngineClient.upstream` (aiohttp, `upstream.py`) carries the completions the proxy forwards: the hot path,
kept as cheap per request as it can be. `EngineClient.http` (httpx) carries everything else: adapter
loads, model lists, health checks, warm-up; admin calls carry their own timeout. Both send the engine's
API key (`set_api_key`, called by the supervisor with each engine start's fresh key).

Errors: `errors.py` has the hierarchy; `EngineRequestError` (a non-2xx answer to an admin call) is here.
"""

from __future__ import annotations

from typing import Any, Protocol

import httpx
from pydantic import BaseModel, ConfigDict

from .errors import EngineError
from .upstream import Upstream

ADMIN_TIMEOUT_S = 60.0
DRAIN_TIMEOUT_S = 600.0  # a policy engine's in-flight generations finishing before its weights change
SCORING_TIMEOUT_S = 120.0  # one prefill of a long sequence on a busy CPU engine
# Admin calls are few; waiting for a free connection longer than the pool timeout means something is stuck.
_ADMIN_LIMITS = httpx.Limits(max_connections=32, max_keepalive_connections=8)
_ADMIN_DEFAULT_TIMEOUT = httpx.Timeout(connect=5.0, read=ADMIN_TIMEOUT_S, write=60.0, pool=60.0)


class EngineRequestError(EngineError):
    """The engine answered `status` (not 2xx) with `body`."""

    def __init__(self, method: str, path: str, status: int, body: str) -> None:
        super().__init__(f"vLLM {method} {path} -> {status}: {body[:500]}")
        self.method = method
        self.path = path
        self.status = status
        self.body = body


class EngineModel(BaseModel):
    """One entry of the engine's `GET /v1/models`: the base model or a loaded LoRA adapter."""

    model_config = ConfigDict(extra="ignore")

    id: str
    root: str | None = None  # the weights' path (adapter dir for LoRA)
    parent: str | None = None  # the base model's name for an adapter; None for the base model


class _ModelList(BaseModel):
    model_config = ConfigDict(extra="ignore")

    data: list[EngineModel]


class AdapterEngine(Protocol):
    """The admin calls the adapter store and the studio make: one engine (`EngineClient`) or all of them
    (`pool.EnginePool`, which loads on every engine and lists what all of them have)."""

    async def load_lora_adapter(self, name: str, path: str) -> None: ...

    async def unload_lora_adapter(self, name: str) -> None: ...

    async def list_models(self) -> list[EngineModel]: ...

    async def token_logprobs(self, model: str, token_ids: list[int], start: int) -> list[float]: ...


class EngineClient:
    """HTTP access to one vLLM OpenAI server at `base_url` (e.g. "http://127.0.0.1:8123")."""

    def __init__(self, base_url: str, *, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.http = httpx.AsyncClient(
            base_url=self.base_url, timeout=_ADMIN_DEFAULT_TIMEOUT, limits=_ADMIN_LIMITS, transport=transport
        )
        self.upstream = Upstream(self.base_url)

    def set_api_key(self, api_key: str) -> None:
        """Send `Authorization: Bearer <api_key>` on every request from now on (both clients)."""
        self.http.headers["Authorization"] = f"Bearer {api_key}"
        self.upstream.set_api_key(api_key)

    async def aclose(self) -> None:
        await self.upstream.aclose()
        await self.http.aclose()

    async def is_healthy(self, timeout_s: float = 5.0) -> bool:
        """`GET /health` answered 200 within `timeout_s` (a refused connection or a timeout is False).

        Sent without the key: until the supervisor has checked that the port is its engine's, whoever
        answers /health may be another process."""
        request = self.http.build_request("GET", "/health", timeout=timeout_s)
        request.headers.pop("Authorization", None)
        try:
            response = await self.http.send(request)
        except httpx.TransportError:  # connect refused/reset, timeouts: the engine is not (yet) healthy
            return False
        return response.status_code == 200

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Load the PEFT adapter directory `path` under the model name `name`."""
        await self._admin_post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})

    async def unload_lora_adapter(self, name: str) -> None:
        await self._admin_post("/v1/unload_lora_adapter", {"lora_name": name})

    async def list_models(self) -> list[EngineModel]:
        response = await self.http.get("/v1/models", timeout=ADMIN_TIMEOUT_S)
        _raise_for_status(response)
        return _ModelList.model_validate_json(response.content).data

    async def token_logprobs(self, model: str, token_ids: list[int], start: int) -> list[float]:
        """The logprob `model` gives each of `token_ids[start:]` after the tokens before it (one prefill, no
        sampling: vLLM's `prompt_logprobs`)."""
        response = await self.http.post("/v1/completions", timeout=SCORING_TIMEOUT_S, json={
            "model": model, "prompt": token_ids, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0})
        _raise_for_status(response)
        entries = response.json()["choices"][0]["prompt_logprobs"]
        return [float(entries[i][str(token_ids[i])]["logprob"]) for i in range(max(start, 1), len(token_ids))]

    async def tokenize(self, model: str, text: str) -> list[int]:
        response = await self.http.post("/tokenize", json={"model": model, "prompt": text}, timeout=ADMIN_TIMEOUT_S)
        _raise_for_status(response)
        return [int(token) for token in response.json()["tokens"]]

    async def merge_weights(self, adapter_path: str | None, version: str) -> None:
        """A policy engine's weights become the base model's plus `adapter_path` folded in (None: the base
        alone), through vLLM's weight-update routes (dev mode) and artlike's `artlike_merge` backend; its
        prefix cache, computed with the old weights, is dropped after. Requests in flight finish first
        (`/pause?mode=wait`); the caller has stopped sending new ones."""
        response = await self.http.post("/pause", params={"mode": "wait"}, timeout=DRAIN_TIMEOUT_S)
        _raise_for_status(response)
        try:
            await self._admin_post("/start_weight_update", None)
            await self._admin_post("/update_weights", {"update_info": {"adapter_path": adapter_path}})
            await self._admin_post("/finish_weight_update", {"weight_version": version})
            await self._admin_post("/reset_prefix_cache", None)
        finally:
            await self._admin_post("/resume", None)

    async def _admin_post(self, path: str, payload: dict[str, Any] | None) -> None:
        response = await self.http.post(path, json=payload, timeout=ADMIN_TIMEOUT_S)
        _raise_for_status(response)


def _raise_for_status(response: httpx.Response) -> None:
    if not response.is_success:
        raise EngineRequestError(
            response.request.method, response.request.url.path, response.status_code, response.text
        )
