"""Every response body and stream chunk of the OpenAI surface validates against the official OpenAPI
schema (tests/data/openai_schemas.json, see tests/openapi_schema.py), on the unrecorded `/v1` and on a
trajectory's `/t/{id}/v1`. Bodies are read as raw JSON with httpx: an SDK would parse leniently and hide
a `null` the schema does not allow."""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import pytest
from artlike_server.launcher import ServerProcess

from tests.openapi_schema import assert_valid, schema_errors

from .helpers import api_url, http_client

pytestmark = pytest.mark.integration

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
MESSAGES = [{"role": "user", "content": "Say hello in three words."}]
WEATHER_MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(params=["v1", "trajectory"])
def base(request: pytest.FixtureRequest, server: ServerProcess) -> str:
    return api_url(server, None if request.param == "v1" else f"shapes-{uuid.uuid4().hex}")


@pytest.fixture(params=["v1", "trajectory"])
def capable(request: pytest.FixtureRequest, capable_server: ServerProcess) -> tuple[ServerProcess, str]:
    """The full model's server and a base URL on it, for a forced call whose arguments the model completes."""
    return capable_server, api_url(capable_server, None if request.param == "v1" else f"shapes-{uuid.uuid4().hex}")


def post(http: httpx.Client, url: str, body: dict[str, Any]) -> dict[str, Any]:
    response = http.post(url, json=body)
    assert response.status_code == 200, response.text
    payload: dict[str, Any] = response.json()
    return payload


def stream(http: httpx.Client, url: str, body: dict[str, Any], *, done: bool = True) -> list[dict[str, Any]]:
    """The `data:` payloads of a server-sent event stream, which ends with `[DONE]` (chat and completions)
    or just ends (`done=False`: the Responses API, whose last event is `response.completed`)."""
    chunks: list[dict[str, Any]] = []
    with http.stream("POST", url, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read().decode()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return chunks
            chunks.append(json.loads(line.removeprefix("data: ")))
    assert not done, "the stream ended without [DONE]"
    return chunks


def chat(server: ServerProcess, **extra: Any) -> dict[str, Any]:
    return {"model": server.model_id, "messages": MESSAGES, "max_tokens": 8, "temperature": 0.0, **extra}


def test_chat_completion(server: ServerProcess, http: httpx.Client, base: str) -> None:
    assert_valid("CreateChatCompletionResponse", post(http, f"{base}/chat/completions", chat(server)))


# vLLM's chat logprobs object has `content` but not `refusal`, which the schema requires (null allowed).
# Fix in openai_api/rewriting.py `_strip_choice`: when `choice["logprobs"]` is a dict with "content", set
# `.setdefault("refusal", None)` (responses and stream chunks). Remove this marker with that fix.


def test_chat_completion_with_logprobs(server: ServerProcess, http: httpx.Client, base: str) -> None:
    body = post(http, f"{base}/chat/completions", chat(server, logprobs=True, top_logprobs=2))
    assert len(body["choices"][0]["logprobs"]["content"]) == body["usage"]["completion_tokens"]
    assert_valid("CreateChatCompletionResponse", body)


def test_every_chat_stream_chunk_with_logprobs(server: ServerProcess, http: httpx.Client, base: str) -> None:
    for chunk in stream(http, f"{base}/chat/completions", chat(server, logprobs=True)):
        assert_valid("CreateChatCompletionStreamResponse", chunk)


def test_chat_completion_with_two_choices(server: ServerProcess, http: httpx.Client, base: str) -> None:
    body = post(http, f"{base}/chat/completions", chat(server, n=2, temperature=1.0, seed=1))
    assert_valid("CreateChatCompletionResponse", body)
    assert [choice["index"] for choice in body["choices"]] == [0, 1]


def test_chat_completion_with_a_required_tool_call(capable: tuple[ServerProcess, str]) -> None:
    server, base = capable
    request = chat(server, messages=WEATHER_MESSAGES, tools=[WEATHER_TOOL], tool_choice="required", max_tokens=96)
    with http_client(server) as http:
        body = post(http, f"{base}/chat/completions", request)
    assert_valid("CreateChatCompletionResponse", body)
    [call] = body["choices"][0]["message"].get("tool_calls") or [None]
    assert call and call["function"]["name"] == "get_weather", json.dumps(body)


@pytest.mark.parametrize("include_usage", [False, True])
def test_every_chat_stream_chunk(server: ServerProcess, http: httpx.Client, base: str, include_usage: bool) -> None:
    options = {"stream_options": {"include_usage": True}} if include_usage else {}
    chunks = stream(http, f"{base}/chat/completions", chat(server, **options))
    assert chunks
    for chunk in chunks:
        assert_valid("CreateChatCompletionStreamResponse", chunk)
    assert (chunks[-1].get("usage") is not None) == include_usage


def test_every_chunk_of_a_streamed_tool_call(server: ServerProcess, http: httpx.Client, base: str) -> None:
    request = chat(server, messages=WEATHER_MESSAGES, tools=[WEATHER_TOOL], tool_choice="required", max_tokens=96)
    chunks = stream(http, f"{base}/chat/completions", request)
    for chunk in chunks:
        assert_valid("CreateChatCompletionStreamResponse", chunk)
    assert any(choice["delta"].get("tool_calls") for chunk in chunks for choice in chunk["choices"])


def test_completion(server: ServerProcess, http: httpx.Client, base: str) -> None:
    request = {"model": server.model_id, "prompt": "The sea is", "max_tokens": 8, "temperature": 0.0}
    assert_valid("CreateCompletionResponse", post(http, f"{base}/completions", request))
    assert_valid("CreateCompletionResponse", post(http, f"{base}/completions", {**request, "logprobs": 2}))


def test_every_completion_stream_chunk(server: ServerProcess, http: httpx.Client, base: str) -> None:
    request = {"model": server.model_id, "prompt": "The sea is", "max_tokens": 8, "temperature": 0.0,
               "stream_options": {"include_usage": True}}
    chunks = stream(http, f"{base}/completions", request)
    # The spec has no stream type for completions: a chunk is a CreateCompletionResponse, except that
    # `finish_reason` is null until the last chunk of a choice, as OpenAI's own API streams it.
    assert [choice["finish_reason"] for chunk in chunks for choice in chunk["choices"]][-1] is not None
    for chunk in chunks:
        choices = [{**choice, "finish_reason": choice["finish_reason"] or "stop"} for choice in chunk["choices"]]
        assert_valid("CreateCompletionResponse", {**chunk, "choices": choices})
    assert chunks[-1]["usage"] is not None and not chunks[-1]["choices"]


def test_models(http: httpx.Client, base: str) -> None:
    response = http.get(f"{base}/models")
    assert response.status_code == 200, response.text
    assert_valid("ListModelsResponse", response.json())


@pytest.mark.parametrize(("body", "status"), [
    ({"messages": MESSAGES}, 400),  # no model
    ({"model": "no-such-model", "messages": MESSAGES}, 404),
    ({"model": None, "messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ({"model": None, "messages": MESSAGES, "temperature": 9}, 400),
    ({"model": None, "messages": [*MESSAGES, {"role": "tool", "content": "18C"}]}, 400),
])
def test_error_bodies(server: ServerProcess, http: httpx.Client, base: str, body: dict[str, Any], status: int) -> None:
    if "model" in body and body["model"] is None:  # None: the served model
        body = {**body, "model": server.model_id}
    response = http.post(f"{base}/chat/completions", json=body)
    assert response.status_code == status, response.text
    assert_valid("ErrorResponse", response.json())


def test_error_bodies_of_malformed_json_and_a_wrong_key(server: ServerProcess, base: str) -> None:
    malformed = httpx.post(f"{base}/chat/completions", content=b"{not json", timeout=30,
                           headers={**server.headers, "Content-Type": "application/json"})
    assert malformed.status_code == 400, malformed.text
    assert_valid("ErrorResponse", malformed.json())
    if server.api_key:
        wrong_key = httpx.get(f"{base}/models", headers={"Authorization": "Bearer wrong"}, timeout=30)
        assert wrong_key.status_code == 401, wrong_key.text
        assert_valid("ErrorResponse", wrong_key.json())


def responses_request(server: ServerProcess, **extra: Any) -> dict[str, Any]:
    return {"model": server.model_id, "input": "Say hello in three words.", "max_output_tokens": 8,
            "temperature": 0.0, **extra}


# The Responses route (openai_api/dialects/responses.py) sends `user: null` (the schema: a string or absent)
# and `usage: null` in the in-progress response of `response.created`/`response.in_progress` (an object or
# absent), and echoes function tools without `strict` (required on FunctionTool). Remove these markers with
# the fix.


def test_a_response(server: ServerProcess, http: httpx.Client, base: str) -> None:
    assert_valid("Response", post(http, f"{base}/responses", responses_request(server)))


def test_a_response_with_a_function_call(capable: tuple[ServerProcess, str]) -> None:
    server, base = capable
    tool = {"type": "function", **WEATHER_TOOL["function"]}
    with http_client(server) as http:
        body = post(http, f"{base}/responses", responses_request(
            server, input="What is the weather in Paris?", tools=[tool], tool_choice="required",
            max_output_tokens=64))
    assert_valid("Response", body)
    assert any(item["type"] == "function_call" for item in body["output"]), body


def test_every_response_stream_event(server: ServerProcess, http: httpx.Client, base: str) -> None:
    events = stream(http, f"{base}/responses", responses_request(server), done=False)
    assert events[-1]["type"] in ("response.completed", "response.incomplete")  # max_output_tokens: incomplete
    # Every event's errors at once (deduplicated): one wrong field usually repeats in many events.
    errors = sorted({error for event in events for error in schema_errors("ResponseStreamEvent", event)})
    assert not errors, "\n".join(errors)
