"""One way for every test to reach a running server (`ServerProcess`): its OpenAI, Anthropic and artlike
clients, plain HTTP with its key, and what it recorded. Tests build their clients here, never by hand, so a
change in how the server is addressed or authenticated is one edit."""

from __future__ import annotations

from typing import Any
from uuid import uuid4

import anthropic
import httpx
import openai
from artlike_server.launcher import ServerProcess

import artlike as art

__all__ = [
    "ServerProcess",
    "anthropic_client",
    "api_url",
    "async_http_client",
    "async_openai_client",
    "http_client",
    "openai_client",
    "recorded",
    "sft_trained_model",
    "trainable_model",
]

# Long enough for a training step or a cold adapter load on 2 CPU cores.
HTTP_TIMEOUT_S = 300.0


def api_url(server: ServerProcess, trajectory_id: str | None = None) -> str:
    """The OpenAI base URL: `/v1`, or `/t/{trajectory_id}/v1` to record the calls under that trajectory."""
    return f"{server.base_url}/t/{trajectory_id}/v1" if trajectory_id else f"{server.base_url}/v1"


def openai_client(server: ServerProcess, trajectory_id: str | None = None, *, max_retries: int = 0,
                  **options: Any) -> openai.OpenAI:
    """The official OpenAI SDK against the server (no retries unless asked: a retry would hide an error)."""
    return openai.OpenAI(base_url=api_url(server, trajectory_id), api_key=server.api_key,
                         max_retries=max_retries, **options)


def async_openai_client(server: ServerProcess, trajectory_id: str | None = None, *, max_retries: int = 0,
                        **options: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=api_url(server, trajectory_id), api_key=server.api_key,
                              max_retries=max_retries, **options)


def anthropic_client(server: ServerProcess, trajectory_id: str | None = None, *, max_retries: int = 0,
                     **options: Any) -> anthropic.Anthropic:
    """The official Anthropic SDK (it appends `/v1/messages` to its base URL itself)."""
    base = f"{server.base_url}/t/{trajectory_id}" if trajectory_id else server.base_url
    return anthropic.Anthropic(base_url=base, api_key=server.api_key, max_retries=max_retries, **options)


def http_client(server: ServerProcess, *, timeout: float = HTTP_TIMEOUT_S) -> httpx.Client:
    """Plain HTTP with the server's key; paths are relative to its base URL (absolute URLs pass through)."""
    return httpx.Client(base_url=server.base_url, headers=server.headers, timeout=timeout)


def async_http_client(server: ServerProcess, *, timeout: float = HTTP_TIMEOUT_S) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=server.base_url, headers=server.headers, timeout=timeout)


def trainable_model(server: ServerProcess, name: str, **options: Any) -> art.TrainableModel:
    """The artlike client's model `name` on the server's base model, with the server's key."""
    options.setdefault("api_key", server.api_key)
    return art.TrainableModel(name, server.model_id, server.base_url, **options)


async def sft_trained_model(server: ServerProcess, prefix: str, conversation: list[dict[str, str]], *,
                            epochs: int, learning_rate: float = 2e-3) -> art.TrainableModel:
    """A new rank-8 model `{prefix}-{random}` whose step 1 the real trainer wrote: SFT on one conversation."""
    model = trainable_model(server, f"{prefix}-{uuid4().hex[:8]}", lora=art.LoraConfig(rank=8))
    await model.register()
    result = await model.train_sft([conversation], epochs=epochs, learning_rate=learning_rate, progress=False)
    assert result.trained and result.step == 1, result
    return model


def recorded(server: ServerProcess, trajectory_id: str) -> list[dict[str, Any]]:
    """The trajectory's recorded completions, as `GET /v1/trajectories/{id}` returns them."""
    with http_client(server, timeout=30) as http:
        response = http.get(f"/v1/trajectories/{trajectory_id}")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["trajectory_id"] == trajectory_id
    completions: list[dict[str, Any]] = body["completions"]
    return completions
