"""The OpenAI surface of a real `artlike serve` (real vLLM, float32), driven by the official `openai` client.

Every completion through a trajectory URL must land in the log token-exact: output token ids that decode to
the returned text, one sampling logprob per token equal to what vLLM reported, the prompt's token ids."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from functools import cache
from typing import Any

import httpx
import openai
import pytest
from artlike_server.default_model import ensure_default_model
from artlike_server.launcher import ServerProcess
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from .helpers import api_url, async_http_client, async_openai_client, openai_client, recorded

pytestmark = pytest.mark.integration

EOS_ID = 2  # <|im_end|>
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@cache
def tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(ensure_default_model())


def new_trajectory() -> str:
    return f"it-{uuid.uuid4().hex}"


def assert_token_exact(row: dict[str, Any]) -> None:
    assert len(row["output_token_ids"]) == len(row["logprobs"])
    assert all(lp <= 0.0 for lp in row["logprobs"])
    assert row["prompt_token_ids"], "the prompt's token ids are recorded"
    if row["finish_reason"] == "stop" and not row["request"].get("stop"):
        assert row["output_token_ids"][-1] == EOS_ID  # vLLM returns the sampled EOS with its logprob


def assert_decodes_to(token_ids: list[int], text: str | None) -> None:
    """The recorded ids decode to the returned text. When sampling stopped inside a multi-byte character
    (finish_reason "length"), vLLM's detokenizer holds back the tokens of the unfinished character, so the
    text then equals the decode of the ids without those last one to three tokens."""
    decoded = tokenizer().decode(token_ids, skip_special_tokens=True)
    if decoded == text or not decoded.endswith("\ufffd"):
        assert decoded == text
        return
    held_back = [tokenizer().decode(token_ids[:cut], skip_special_tokens=True) for cut in range(-1, -4, -1)]
    assert text in held_back, (decoded, text)


def messages(question: str = "What is the capital of France?") -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


# --------------------------------------------------------------------------------------- completions


def test_chat_completion_is_recorded_token_exact(server: ServerProcess) -> None:
    trajectory = new_trajectory()
    response = openai_client(server, trajectory).chat.completions.create(
        model=server.model_id, messages=messages(), max_tokens=40, temperature=0
    )
    choice = response.choices[0]
    assert response.model == server.model_id
    assert choice.logprobs is None  # forced for the log, removed for the caller
    assert "token_ids" not in (choice.model_extra or {}) and "prompt_token_ids" not in (
        response.model_extra or {}
    )
    assert response.usage is not None and response.usage.completion_tokens > 0

    (row,) = recorded(server, trajectory)
    assert row["request_id"] == response.id and row["choice_index"] == 0
    assert (row["model"], row["served_model"], row["step"]) == (server.model_id, server.model_id, None)
    assert row["request"]["messages"] == messages()
    assert row["finish_reason"] == choice.finish_reason
    assert_token_exact(row)
    assert len(row["output_token_ids"]) == response.usage.completion_tokens
    assert len(row["prompt_token_ids"]) == response.usage.prompt_tokens
    assert_decodes_to(row["output_token_ids"], choice.message.content)
    prompt = tokenizer().decode(row["prompt_token_ids"])
    assert prompt.endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_logprobs_when_asked_match_the_log(server: ServerProcess) -> None:
    trajectory = new_trajectory()
    response = openai_client(server, trajectory).chat.completions.create(
        model=server.model_id, messages=messages(), max_tokens=12, logprobs=True, top_logprobs=2,
        temperature=0,  # greedy: a sampled byte-fallback token (half a UTF-8 character) has no text of its own
    )
    content = response.choices[0].logprobs.content
    assert all(len(entry.top_logprobs) == 2 for entry in content)
    (row,) = recorded(server, trajectory)
    assert row["logprobs"] == [entry.logprob for entry in content]
    assert [tokenizer().decode([token_id]) for token_id in row["output_token_ids"]] == [
        e.token for e in content
    ]

    plain = new_trajectory()
    response = openai_client(server, plain).chat.completions.create(
        model=server.model_id, messages=messages(), max_tokens=4
    )
    assert response.choices[0].logprobs is None
    assert len(recorded(server, plain)[0]["logprobs"]) == 4


async def test_streaming_is_recorded(server: ServerProcess) -> None:
    trajectory = new_trajectory()
    stream = await async_openai_client(server, trajectory).chat.completions.create(
        model=server.model_id, messages=messages("Count to five."), max_tokens=30, temperature=0, stream=True
    )
    text, finish_reason, ids = "", None, set()
    async for chunk in stream:
        ids.add(chunk.id)
        assert chunk.model == server.model_id
        assert "token_ids" not in (chunk.model_extra or {}) and chunk.usage is None
        for choice in chunk.choices:
            text += choice.delta.content or ""
            assert choice.logprobs is None
            finish_reason = choice.finish_reason or finish_reason
    (row,) = recorded(server, trajectory)  # recorded before [DONE] was sent
    assert ids == {row["request_id"]}
    assert row["finish_reason"] == finish_reason
    assert_token_exact(row)
    assert_decodes_to(row["output_token_ids"], text)

    # the same greedy request without streaming gives the same tokens and logprobs
    twin = new_trajectory()
    openai_client(server, twin).chat.completions.create(
        model=server.model_id, messages=messages("Count to five."), max_tokens=30, temperature=0
    )
    (same,) = recorded(server, twin)
    assert same["output_token_ids"] == row["output_token_ids"]
    assert same["logprobs"] == pytest.approx(row["logprobs"], abs=1e-4)


def test_n4_records_one_row_per_choice(server: ServerProcess) -> None:
    trajectory = new_trajectory()
    response = openai_client(server, trajectory).chat.completions.create(
        model=server.model_id, messages=messages(), max_tokens=16, temperature=1.0, n=4
    )
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    rows = recorded(server, trajectory)
    assert [r["choice_index"] for r in rows] == [0, 1, 2, 3]
    assert {r["request_id"] for r in rows} == {response.id}
    for row, choice in zip(rows, response.choices, strict=True):
        assert_token_exact(row)
        assert_decodes_to(row["output_token_ids"], choice.message.content)


async def test_n2_streaming_records_both_choices(server: ServerProcess) -> None:
    trajectory = new_trajectory()
    stream = await async_openai_client(server, trajectory).chat.completions.create(
        model=server.model_id,
        messages=messages(),
        max_tokens=12,
        temperature=1.0,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts = ["", ""]
    usage = None
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    rows = recorded(server, trajectory)
    assert usage is not None and usage.completion_tokens == sum(len(r["output_token_ids"]) for r in rows)
    for row, text in zip(rows, texts, strict=True):
        assert_token_exact(row)
        assert_decodes_to(row["output_token_ids"], text)


def test_stop_and_length(server: ServerProcess) -> None:
    plain = openai_client(server).chat.completions.create(
        model=server.model_id, messages=messages(), max_tokens=30, temperature=0
    )
    text = plain.choices[0].message.content
    stop = text.split()[-1]  # the greedy answer's last word
    trajectory = new_trajectory()
    stopped = openai_client(server, trajectory).chat.completions.create(
        model=server.model_id, messages=messages(), max_tokens=30, temperature=0, stop=[stop]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == text[: text.index(stop)]
    (row,) = recorded(server, trajectory)
    assert_token_exact(row)
    # vLLM keeps the tokens that formed the stop string (sampled, so trainable) and cuts only the text
    assert stop in tokenizer().decode(row["output_token_ids"])

    short = new_trajectory()
    cut = openai_client(server, short).chat.completions.create(
        model=server.model_id, messages=messages(), max_completion_tokens=3, temperature=0
    )
    assert cut.choices[0].finish_reason == "length"
    (row,) = recorded(server, short)
    assert len(row["output_token_ids"]) == len(row["logprobs"]) == 3 and row["finish_reason"] == "length"


def test_named_tool_choice_gives_a_parsed_tool_call(capable_server: ServerProcess) -> None:
    server = capable_server  # a call whose arguments the model completes: the full model
    trajectory = new_trajectory()
    response = openai_client(server, trajectory).chat.completions.create(
        model=server.model_id,
        messages=messages("What is the weather in Paris?"),
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=80,
        temperature=0,
    )
    (call,) = response.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments), dict)
    (row,) = recorded(server, trajectory)
    assert row["request"]["tools"] == [WEATHER_TOOL]
    assert_token_exact(row)


def test_response_format_json_object(server: ServerProcess) -> None:
    trajectory = new_trajectory()
    response = openai_client(server, trajectory).chat.completions.create(
        model=server.model_id,
        messages=messages("Describe Paris as a JSON object with the keys name and country."),
        response_format={"type": "json_object"},
        max_tokens=60,
        temperature=0,
    )
    content = response.choices[0].message.content
    assert content.lstrip().startswith("{")
    if response.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    (row,) = recorded(server, trajectory)
    assert_token_exact(row)


def test_completions_endpoint(server: ServerProcess) -> None:
    trajectory = new_trajectory()
    response = openai_client(server, trajectory).completions.create(
        model=server.model_id, prompt="The capital of France is", max_tokens=8, temperature=0, logprobs=1
    )
    choice = response.choices[0]
    (row,) = recorded(server, trajectory)
    assert row["endpoint"] == "completions"
    assert row["prompt_token_ids"] == tokenizer()("The capital of France is")["input_ids"]
    assert_decodes_to(row["output_token_ids"], choice.text)
    assert row["logprobs"] == choice.logprobs.token_logprobs


def test_plain_v1_routes_are_not_recorded(server: ServerProcess) -> None:
    response = openai_client(server).chat.completions.create(
        model=server.model_id, messages=messages(), max_tokens=4
    )
    assert response.choices[0].logprobs is None
    models = openai_client(server).models.list()
    assert server.model_id in [m.id for m in models.data]


async def test_client_disconnect_records_the_partial_completion(server: ServerProcess) -> None:
    trajectory = new_trajectory()
    body = {
        "model": server.model_id,
        "messages": messages("Write a very long story about a dragon."),
        "max_tokens": 2000,
        "ignore_eos": True,  # vLLM extension: keeps generating, so only the disconnect can end it early
        "stream": True,
    }
    url = f"{server.base_url}/t/{trajectory}/v1/chat/completions"
    async with (
        async_http_client(server) as http,
        http.stream("POST", url, json=body) as response,
    ):
        events = 0
        async for line in response.aiter_lines():
            events += line.startswith("data: ")
            if events == 8:
                break
    # The partial row is queued while the request unwinds; poll the log (a separate request) briefly.
    async with async_http_client(server, timeout=30) as http:
        for _ in range(100):
            found = await http.get(f"{server.base_url}/v1/trajectories/{trajectory}")
            if found.status_code == 200:
                break
        assert found.status_code == 200
    (row,) = found.json()["completions"]
    assert row["finish_reason"] == "abort"
    assert 0 < len(row["output_token_ids"]) < 2000
    assert len(row["output_token_ids"]) == len(row["logprobs"])


# ------------------------------------------------------------------------------------------- errors


def post(server: ServerProcess, path: str, *, headers: dict[str, str] | None = None, **kwargs: Any) -> httpx.Response:
    return httpx.post(
        f"{server.base_url}{path}",
        headers=server.headers if headers is None else headers,
        timeout=60,
        **kwargs,
    )


def test_malformed_json_is_400(server: ServerProcess) -> None:
    response = post(server, "/v1/chat/completions", content=b'{"model": ')
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"


def test_schema_error_names_the_parameter(server: ServerProcess) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client(server).chat.completions.create(model=server.model_id, messages=messages(), n=0)
    assert caught.value.param == "n"
    response = post(server, "/t/x1/v1/chat/completions", json={"model": server.model_id, "messages": "hi"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"


def test_unknown_model_and_step_are_404(server: ServerProcess) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        openai_client(server).chat.completions.create(model="no-such-model", messages=messages())
    assert caught.value.param == "model"
    name = f"m{uuid.uuid4().hex[:8]}"
    registered = post(server, "/v1/trainable_models", json={"name": name, "base_model": server.model_id})
    assert registered.status_code in (200, 201), registered.text
    ids = [m.id for m in openai_client(server).models.list().data]
    assert name in ids and f"{name}@0" in ids
    with pytest.raises(openai.NotFoundError):
        openai_client(server, new_trajectory()).chat.completions.create(model=f"{name}@99", messages=messages())


def test_oversized_body_is_413(server: ServerProcess) -> None:
    response = post(server, "/v1/chat/completions", content=b" " * (33 * 1024 * 1024))
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


@pytest.mark.parametrize("path", ["/_train_model", "/v1/trainable_models", "/t/chunked/v1/chat/completions"])
def test_a_chunked_body_over_the_limit_is_413_on_every_kind_of_route(server: ServerProcess, path: str) -> None:
    def chunks() -> Iterator[bytes]:  # no Content-Length: the server counts as it reads
        yield b'{"model": "' + b"x" * (1 << 20)
        for _ in range(33):
            yield b"x" * (1 << 20)

    response = post(server, path, content=chunks(), headers={**server.headers, "content-type": "application/json"})
    assert "content-length" not in response.request.headers
    assert response.status_code == 413, response.text
    assert response.json()["error"]["code"] == "request_too_large"


def test_api_key_is_enforced(server: ServerProcess) -> None:
    wrong = openai.OpenAI(base_url=api_url(server), api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    body = {"model": server.model_id, "messages": messages()}
    assert post(server, "/t/x2/v1/chat/completions", json=body, headers={}).status_code == 401
    assert httpx.get(f"{server.base_url}/metrics", timeout=30).status_code == 401


def test_bad_trajectory_id_is_400(server: ServerProcess) -> None:
    body = {"model": server.model_id, "messages": messages()}
    for path in (
        "/t/bad.id/v1/chat/completions",
        "/t/_x/v1/chat/completions",
        f"/t/{'a' * 129}/v1/chat/completions",
    ):
        response = post(server, path, json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == "trajectory_id"
    assert httpx.get(f"{server.base_url}/v1/trajectories/bad.id", headers=server.headers).status_code == 400
    assert (
        httpx.get(f"{server.base_url}/v1/trajectories/never-used", headers=server.headers).status_code == 404
    )


def test_metrics_endpoint(server: ServerProcess) -> None:
    openai_client(server, new_trajectory()).chat.completions.create(
        model=server.model_id, messages=messages(), max_tokens=4
    )
    exposition = httpx.get(f"{server.base_url}/metrics", headers=server.headers, timeout=30).text
    assert 'route="/t/{trajectory_id}/v1/chat/completions"' in exposition
    for name in (
        "artlike_requests_total",
        "artlike_completion_tokens_total",
        "artlike_completions_recorded_total",
        "artlike_adapter_swaps_total",
        "artlike_engine_restarts",
    ):
        assert name in exposition
