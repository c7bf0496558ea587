"""Bounded memory in the proxy: one completion request may ask for at most `--max-request-tokens` token entries
(n × max_tokens × (1 + top_logprobs)), on every route and dialect, refused before the engine is asked; and
the default bounds the engine answer the proxy reads whole (measured on the real engine)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from artlike_server.completion_log import CompletionLog
from artlike_server.errors import InvalidRequest
from artlike_server.launcher import ServerProcess
from artlike_server.openai_api.dialects.anthropic_messages import MessagesDialect
from artlike_server.openai_api.dialects.responses import ResponsesDialect
from artlike_server.openai_api.request_caps import ALL_TOKENS, check_request_size, entries
from artlike_server.settings import LimitsSettings

from tests.unit.openai_fakes import FakeModels, FakeVLLM, Settings, build_app

DEFAULT_LIMIT = 16 * 4096 * 21
MESSAGES = [{"role": "user", "content": "Count to ten."}]


def _refusal(endpoint: Any, body: dict[str, Any], *, limit: int = DEFAULT_LIMIT, dialect: str | None = None
             ) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as refused:
        check_request_size(endpoint, body, limit=limit, max_model_len=4096, dialect=dialect)
    assert refused.value.code == "request_too_large"
    return refused.value


def test_the_default_is_the_cli_default() -> None:
    assert LimitsSettings().max_request_tokens == DEFAULT_LIMIT


@pytest.mark.parametrize(("endpoint", "body", "total"), [
    ("chat.completions", {"max_tokens": 100}, 100),
    ("chat.completions", {}, 4096),  # no max_tokens: the model's length
    ("chat.completions", {"max_tokens": 10 ** 9}, 4096),  # more than the model's length cannot be generated
    ("chat.completions", {"n": 16, "max_completion_tokens": 4096, "logprobs": True, "top_logprobs": 20}, DEFAULT_LIMIT),
    ("chat.completions", {"max_tokens": 10, "top_logprobs": 5}, 10),  # without logprobs, no alternatives
    ("chat.completions", {"max_tokens": 1, "logprobs": True, "top_logprobs": -1}, 1 + ALL_TOKENS),
    ("chat.completions", {"max_tokens": 1, "prompt_logprobs": 2}, 1 + 4096 * 3),
    ("completions", {"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 10, "logprobs": 4}, 3 * 2 * 10 * 5),
    ("completions", {"prompt": [1, 2, 3], "max_tokens": 10}, 10),  # one prompt of token ids
    ("completions", {"prompt": "a", "n": 2, "best_of": 8, "max_tokens": 10}, 80),
    ("completions", {"prompt": "a", "max_tokens": 1, "echo": True, "logprobs": 1}, 2 + 4096 * 2),
])
def test_what_a_request_counts(endpoint: Any, body: dict[str, Any], total: int) -> None:
    assert entries(endpoint, body, max_model_len=4096).total == total
    check_request_size(endpoint, body, limit=total, max_model_len=4096)
    _refusal(endpoint, body, limit=total - 1)


@pytest.mark.parametrize(("endpoint", "body", "dialect", "param"), [
    ("chat.completions", {"n": 17, "max_tokens": 4096, "logprobs": True, "top_logprobs": 20}, None, "top_logprobs"),
    ("chat.completions", {"n": 128, "max_tokens": 4096, "logprobs": True, "top_logprobs": 2}, None, "top_logprobs"),
    ("completions", {"prompt": "a", "n": 128, "logprobs": 20, "max_tokens": 4096}, None, "logprobs"),
    ("completions", {"prompt": ["a"] * 400, "max_tokens": 4096}, None, "prompt"),
    ("chat.completions", {"max_tokens": 4096, "logprobs": True, "top_logprobs": -1}, "responses", "top_logprobs"),
    ("chat.completions", {"max_tokens": 1, "prompt_logprobs": -1}, None, "prompt_logprobs"),
])
def test_a_refusal_names_the_field_to_lower(endpoint: Any, body: dict[str, Any], dialect: str | None,
                                            param: str) -> None:
    error = _refusal(endpoint, body, dialect=dialect)
    assert error.param == param and "--max-request-tokens" in error.message and f"{DEFAULT_LIMIT:,}" in error.message


def test_without_logprobs_the_choices_are_blamed() -> None:
    assert _refusal("chat.completions", {"n": 128, "logprobs": True}, limit=100_000).param == "n"


def test_the_responses_api_names_its_own_field() -> None:
    error = _refusal("chat.completions", {"max_tokens": 2_000_000}, limit=1000, dialect="responses")
    assert error.param == "max_output_tokens" and "max_output_tokens=4096" in error.message


# ------------------------------------------------- every route and dialect, in-process with a lower cap

SMALL_LIMIT = 1000
REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/chat/completions", {"messages": MESSAGES, "n": 2, "max_tokens": 500, "logprobs": True, "top_logprobs": 1},
     "top_logprobs"),
    ("/v1/completions", {"prompt": "Count to ten.", "n": 3, "max_tokens": 400}, "n"),
    ("/v1/responses", {"input": "Count to ten.", "max_output_tokens": 1001}, "max_output_tokens"),
    ("/v1/messages", {"messages": MESSAGES, "max_tokens": 1001}, "max_tokens"),
]


@pytest.fixture
async def proxy(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, FakeVLLM]]:
    fake = FakeVLLM()
    upstream = await fake.start()
    log = CompletionLog(tmp_path / "completions.sqlite")
    log.open()
    app = build_app(upstream, log, models=FakeModels("base/model", {"agent": 1}),
                    settings=Settings(max_request_tokens=SMALL_LIMIT))
    app.state.artlike.dialects = {"responses": ResponsesDialect(None), "messages": MessagesDialect()}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as http:
        yield http, fake
    await upstream.aclose()
    await fake.stop()
    log.close()


@pytest.mark.parametrize("prefix", ["", "/t/request-caps"])
@pytest.mark.parametrize(("path", "body", "param"), REFUSED)
async def test_every_route_and_dialect_refuses_before_the_engine_is_asked(
        proxy: tuple[httpx.AsyncClient, FakeVLLM], prefix: str, path: str, body: dict[str, Any], param: str) -> None:
    http, engine = proxy
    response = await http.post(prefix + path, json={"model": "agent", **body})
    assert response.status_code == 400, response.text
    if path == "/v1/messages":  # Anthropic's error shape has no param or code: the message names the field
        assert response.json()["error"]["type"] == "invalid_request_error"
        assert "lower max_tokens" in response.json()["error"]["message"]
    else:
        error = response.json()["error"]
        assert (error["param"], error["code"]) == (param, "request_too_large"), error
    assert engine.requests == []
    fits = {**body, **{param: 1}} if param != "top_logprobs" else {**body, "top_logprobs": 0}
    assert (await http.post(prefix + path, json={"model": "agent", **fits})).status_code == 200


# ----------------------------------------------------------------------------------- the real server


@pytest.mark.integration
@pytest.mark.parametrize("prefix", ["", "/t/request-caps"])
@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": MESSAGES, "n": 128, "max_tokens": 4096, "logprobs": True,
                              "top_logprobs": 20}, "top_logprobs"),
    ("/v1/completions", {"prompt": "Count to ten.", "n": 128, "max_tokens": 4096, "logprobs": 20}, "logprobs"),
])
async def test_the_real_server_refuses_gigabytes_of_logprobs_at_once(
        async_http: httpx.AsyncClient, server: ServerProcess, prefix: str, path: str, body: dict[str, Any], param: str) -> None:
    started = time.monotonic()
    response = await async_http.post(prefix + path, json={"model": server.model_id, **body})
    assert response.status_code == 400, response.text
    assert (response.json()["error"]["param"], response.json()["error"]["code"]) == (param, "request_too_large")
    assert time.monotonic() - started < 1.0  # 128 × 4096 tokens would take the engine hours: it was never asked


@pytest.mark.integration
async def test_the_largest_answer_the_default_allows(async_http: httpx.AsyncClient, server: ServerProcess) -> None:
    """The engine's JSON per token entry, measured with 20 alternatives on a recorded request (token ids
    too), bounds what the default lets one answer hold."""
    tokens = 16
    body = {"model": server.model_id, "messages": MESSAGES, "max_tokens": tokens, "logprobs": True,
            "top_logprobs": 20, "temperature": 1.0, "ignore_eos": True}
    response = await async_http.post("/t/request-caps-size/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    logprobs = response.json()["choices"][0]["logprobs"]["content"]
    assert len(logprobs) == tokens
    per_entry = len(orjson.dumps(logprobs)) / (tokens * 21)
    largest = per_entry * DEFAULT_LIMIT
    print(f"{per_entry:.1f} bytes of logprobs JSON per token entry: the default allows {largest / 1e6:.0f} MB")
    assert largest < 256e6
