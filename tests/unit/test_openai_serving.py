"""The OpenAI surface without a real engine: pure rewriting/recording functions, then the routers end to end
against `FakeVLLM` (vLLM 0.32's response shapes) for forwarding, recording, streaming and every error path."""

from __future__ import annotations

import asyncio
import doctest
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from artlike_server.completion_log import CompletionLog
from artlike_server.engine.upstream import Upstream
from artlike_server.errors import InvalidRequest, NotFound, ServiceUnavailable
from artlike_server.metrics import Metrics
from artlike_server.openai_api import api_router, rewriting, serving
from artlike_server.openai_api.api_router import RouteTemplate, SSEResponse, match_completion_path
from artlike_server.openai_api.protocol import validate_request
from artlike_server.openai_api.recording import (
    CompletionTrace,
    LogprobAlignmentError,
    RecordContext,
    aligned_logprobs,
)
from artlike_server.openai_api.rewriting import (
    CallerAsked,
    prepare_upstream_body,
    rewrite_chunk,
    rewrite_response,
)
from artlike_server.openai_api.serving import OpenAIServing, engine_error
from artlike_server.openai_api.streaming import ProxyStream, split_sse_events

from tests.unit.openai_fakes import (
    PROMPT_IDS,
    TEXT,
    TOKENS,
    FakeEngine,
    FakeModels,
    FakeVLLM,
    Settings,
    build_app,
    fake_logprob,
)

BASE = "base/model"
OUTPUT_IDS = [token_id for token_id, _ in TOKENS]
MESSAGES = [{"role": "user", "content": "What is 2+2?"}]

# ---------------------------------------------------------------------------------- request checks


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": MESSAGES}, "model"),
        ({"model": "m"}, "messages"),
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": "hi"}, "messages"),
        ({"model": 3, "messages": MESSAGES}, "model"),
        ({"model": "m", "messages": MESSAGES, "n": 0}, "n"),
        ({"model": "m", "messages": MESSAGES, "n": "2"}, "n"),  # strict: no string coercion
        ({"model": "m", "messages": MESSAGES, "n": True}, "n"),
        ({"model": "m", "messages": MESSAGES, "max_tokens": -1}, "max_tokens"),
        ({"model": "m", "messages": MESSAGES, "max_completion_tokens": 0}, "max_completion_tokens"),
        ({"model": "m", "messages": MESSAGES, "temperature": 2.5}, "temperature"),
        ({"model": "m", "messages": MESSAGES, "top_p": 0}, "top_p"),
        ({"model": "m", "messages": MESSAGES, "stop": 5}, "stop"),
        ({"model": "m", "messages": MESSAGES, "logprobs": "yes"}, "logprobs"),
        ({"model": "m", "messages": MESSAGES, "top_logprobs": 3}, "top_logprobs"),
        ({"model": "m", "messages": MESSAGES, "tools": {"type": "function"}}, "tools"),
        ({"model": "m", "messages": MESSAGES, "stream": "true"}, "stream"),
        ({"model": "m\x00", "messages": MESSAGES}, "model"),
    ],
)
def test_chat_request_errors_name_the_parameter(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        validate_request("chat.completions", body)
    assert caught.value.param == param
    assert param in caught.value.message


def test_completion_request_checks() -> None:
    validate_request("completions", {"model": "m", "prompt": [1, 2, 3], "logprobs": 2, "temperature": 1})
    for body, param in [
        ({"model": "m"}, "prompt"),
        ({"model": "m", "prompt": "x", "logprobs": True}, "logprobs"),
        ({"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ]:
        with pytest.raises(InvalidRequest) as caught:
            validate_request("completions", body)
        assert caught.value.param == param


def test_unknown_fields_pass_validation() -> None:
    request = validate_request(
        "chat.completions", {"model": "m", "messages": MESSAGES, "top_k": 5, "min_p": 0.1}
    )
    assert request.model == "m"


# ------------------------------------------------------------------------------- request rewriting


def test_recording_forces_token_ids_and_logprobs_without_touching_the_callers_body() -> None:
    body = {
        "model": "agent",
        "messages": MESSAGES,
        "stream": True,
        "stream_options": {"continuous_usage_stats": True},
    }
    upstream, asked = prepare_upstream_body("chat.completions", body, "agent@2", record=True)
    assert upstream["model"] == "agent@2"
    assert upstream["logprobs"] is True and upstream["return_token_ids"] is True
    assert upstream["stream_options"] == {"continuous_usage_stats": True, "include_usage": True}
    assert asked == CallerAsked()  # the caller asked for none of the forced fields
    assert body == {
        "model": "agent",
        "messages": MESSAGES,
        "stream": True,
        "stream_options": {"continuous_usage_stats": True},
    }


def test_worked_examples_in_docstrings() -> None:
    attempted = sum(doctest.testmod(module, raise_on_error=True).attempted for module in (serving, rewriting))
    assert attempted >= 1


def test_plain_routes_force_nothing_but_usage_on_streams() -> None:
    upstream, _ = prepare_upstream_body(
        "chat.completions", {"model": "b", "messages": MESSAGES}, "b", record=False
    )
    assert upstream == {"model": "b", "messages": MESSAGES}
    body = {"model": "b", "messages": MESSAGES, "stream": True}
    upstream, asked = prepare_upstream_body("chat.completions", body, "b", record=False)
    assert upstream == body | {"stream_options": {"include_usage": True}}  # token metrics come from usage
    assert not asked.usage


def test_what_the_caller_asked_for_is_kept() -> None:
    body = {"model": "m", "prompt": "x", "logprobs": 3, "return_token_ids": True, "echo": False}
    upstream, asked = prepare_upstream_body("completions", body, "m@0", record=True)
    assert upstream["logprobs"] == 3
    assert asked.logprobs and asked.token_ids
    upstream, asked = prepare_upstream_body("completions", {"model": "m", "prompt": "x"}, "m@0", record=True)
    assert upstream["logprobs"] == 0 and not asked.logprobs


def test_hidden_reasoning_is_generated_but_stripped() -> None:
    # vLLM drops token ids from the answer along with hidden reasoning, so the proxy asks for it and strips it.
    body = {"model": "m", "messages": MESSAGES, "include_reasoning": False}
    upstream, asked = prepare_upstream_body("chat.completions", body, "m", record=True)
    assert upstream["include_reasoning"] is True and not asked.reasoning
    payload = {
        "model": "m",
        "choices": [{"index": 0, "message": {"content": "4", "reasoning": "2+2"}, "logprobs": None}],
    }
    rewrite_response(payload, asked, "m")
    assert payload["choices"][0]["message"] == {"content": "4"}


# ------------------------------------------------------------------------------ response rewriting


def vllm_chat_response(*, n: int = 1) -> dict[str, Any]:
    fake = FakeVLLM()
    body = {"model": "agent@2", "messages": MESSAGES, "n": n, "logprobs": True, "return_token_ids": True}
    return fake._response(body, chat=True)


def test_response_rewrite_strips_forced_and_null_vllm_fields() -> None:
    payload = vllm_chat_response(n=2)
    payload["choices"][1]["stop_reason"] = "</answer>"  # a matched stop string: informative, kept
    rewrite_response(payload, CallerAsked(), "agent@2")
    assert set(payload) == {
        "id",
        "object",
        "created",
        "model",
        "choices",
        "service_tier",
        "system_fingerprint",
        "usage",
    }
    assert payload["model"] == "agent@2"
    first, second = payload["choices"]
    assert set(first) == {"index", "message", "logprobs", "finish_reason"}
    assert first["logprobs"] is None  # the OpenAI schema requires the key: null when not requested
    assert "reasoning" not in first["message"] and first["message"]["content"] == TEXT
    assert second["stop_reason"] == "</answer>"


def test_response_rewrite_keeps_what_was_asked() -> None:
    payload = vllm_chat_response()
    rewrite_response(payload, CallerAsked(logprobs=True, token_ids=True), "agent@2")
    assert payload["prompt_token_ids"] == PROMPT_IDS
    assert payload["choices"][0]["token_ids"] == OUTPUT_IDS
    assert len(payload["choices"][0]["logprobs"]["content"]) == len(OUTPUT_IDS)


def chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m@1",
        "choices": choices,
    } | extra


def test_chunk_rewrite() -> None:
    asked = CallerAsked()
    role = chunk(
        [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
    )
    role["prompt_token_ids"], role["prompt_text"] = PROMPT_IDS, None
    assert rewrite_chunk(role, asked, "m@1")
    assert set(role) == {"id", "object", "created", "model", "choices"}

    token = chunk(
        [
            {
                "index": 0,
                "delta": {"content": "4"},
                "logprobs": {"content": []},
                "finish_reason": None,
                "token_ids": [36],
            }
        ]
    )
    assert rewrite_chunk(token, asked, "m@1")
    assert token["choices"] == [
        {"index": 0, "delta": {"content": "4"}, "logprobs": None, "finish_reason": None}
    ]

    # a chunk vLLM only sent because token ids were forced (e.g. a tool-call control token): dropped
    silent = chunk(
        [{"index": 0, "delta": {}, "logprobs": {"content": []}, "finish_reason": None, "token_ids": [7]}]
    )
    assert not rewrite_chunk(silent, asked, "m@1")

    final = chunk(
        [
            {
                "index": 0,
                "delta": {},
                "logprobs": None,
                "finish_reason": "stop",
                "stop_reason": None,
                "token_ids": [2],
            }
        ]
    )
    assert rewrite_chunk(final, asked, "m@1")
    assert final["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]

    usage = chunk([], usage={"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10})
    assert not rewrite_chunk(dict(usage), asked, "m@1")  # forced include_usage: not for this caller
    assert rewrite_chunk(usage, CallerAsked(usage=True), "m@1")

    error = {"error": {"message": "boom", "type": "InternalServerError", "param": None, "code": 500}}
    assert rewrite_chunk(error, asked, "m@1") and error["error"]["message"] == "boom"


def test_sse_events_survive_any_split() -> None:
    events = [b"data: " + orjson.dumps({"i": i, "text": "a\nb"}) for i in range(5)] + [
        b": keep-alive",
        b"data: [DONE]",
    ]
    stream = b"".join(event + b"\n\n" for event in events)
    for size in (1, 3, 7, len(stream)):
        buffer = bytearray()
        seen: list[bytes] = []
        for start in range(0, len(stream), size):
            seen.extend(split_sse_events(buffer, stream[start : start + size]))
        assert seen == events and not buffer


# ------------------------------------------------------------------------------------- recording


def context(trajectory_id: str = "traj-1") -> RecordContext:
    return RecordContext(
        trajectory_id=trajectory_id,
        endpoint="chat.completions",
        requested_model="agent",
        served_model="agent@2",
        step=2,
        request=b'{"model":"agent"}',
        created_at=1.0,
        started=0.0,
    )


def test_trace_of_an_interleaved_n2_stream() -> None:
    fake = FakeVLLM()
    body = {
        "model": "agent@2",
        "messages": MESSAGES,
        "n": 2,
        "stream": True,
        "logprobs": True,
        "return_token_ids": True,
    }
    trace = CompletionTrace("chat.completions")
    for piece in fake._chunks(body, chat=True):
        trace.add(piece)
    rows = trace.records(context())
    assert [row.choice_index for row in rows] == [0, 1]
    for row in rows:
        assert row.request_id == "chatcmpl-fake"
        assert row.prompt_token_ids == PROMPT_IDS
        assert row.output_token_ids == OUTPUT_IDS  # EOS (2) included, as vLLM samples and returns it
        assert row.logprobs == [fake_logprob(row.choice_index, k) for k in range(len(OUTPUT_IDS))]
        assert row.finish_reason == "stop"
        assert (row.served_model, row.step, row.model) == ("agent@2", 2, "agent")


def test_trace_of_a_completions_response_takes_per_choice_prompts() -> None:
    fake = FakeVLLM()
    payload = fake._response(
        {"model": "m", "prompt": "x", "logprobs": 0, "return_token_ids": True}, chat=False
    )
    trace = CompletionTrace("completions")
    trace.add(payload)
    (row,) = trace.records(context())
    assert row.prompt_token_ids == PROMPT_IDS and row.output_token_ids == OUTPUT_IDS
    assert row.logprobs == [fake_logprob(0, k) for k in range(len(OUTPUT_IDS))]


def test_misaligned_logprobs_are_refused() -> None:
    assert aligned_logprobs([5, 6], [-0.5, -0.25]) == [-0.5, -0.25]
    with pytest.raises(LogprobAlignmentError):
        aligned_logprobs([5, 6], [-0.5])
    with pytest.raises(LogprobAlignmentError):
        aligned_logprobs([5, 6], [None, -0.25])
    trace = CompletionTrace("chat.completions")
    trace.add(vllm_chat_response() | {"prompt_token_ids": None})
    with pytest.raises(LogprobAlignmentError):
        trace.records(context())


def test_aborted_trace_keeps_partial_choices_and_skips_empty_ones() -> None:
    trace = CompletionTrace("chat.completions")
    trace.add(
        chunk(
            [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}], prompt_token_ids=PROMPT_IDS
        )
    )
    trace.add(
        chunk(
            [{"index": 1, "delta": {"role": "assistant"}, "finish_reason": None}], prompt_token_ids=PROMPT_IDS
        )
    )
    trace.add(
        chunk(
            [
                {
                    "index": 0,
                    "delta": {"content": "The"},
                    "token_ids": [504],
                    "logprobs": {"content": [{"logprob": -0.5}]},
                }
            ]
        )
    )
    (row,) = trace.records(context(), aborted=True)
    assert (row.choice_index, row.output_token_ids, row.logprobs, row.finish_reason) == (
        0,
        [504],
        [-0.5],
        "abort",
    )


# ---------------------------------------------------------------------------------- engine errors


def test_engine_errors_keep_status_and_parameter() -> None:
    body = b'{"error":{"message":"n must be 1 when using greedy sampling","type":"BadRequestError","param":"n","code":400}}'
    error = engine_error(400, body, retry_after=3)
    assert isinstance(error, InvalidRequest) and error.param == "n"
    assert error.body()["error"]["type"] == "invalid_request_error"
    assert isinstance(engine_error(404, b'{"error":{"message":"no such model"}}', retry_after=3), NotFound)
    unavailable = engine_error(503, b"", retry_after=3)
    assert isinstance(unavailable, ServiceUnavailable) and unavailable.headers["Retry-After"] == "3"
    internal = engine_error(500, b"Internal Server Error", retry_after=3)
    assert internal.status_code == 500 and "Internal Server Error" in internal.message
    assert engine_error(422, b"{}", retry_after=3).status_code == 422


# ----------------------------------------------------------------------------- through the routers


class Proxy:
    """The app around a FakeVLLM (over real HTTP), plus its log and metrics. `await Proxy.start(...)`."""

    def __init__(self, tmp_path: Path, fake: FakeVLLM, upstream: Upstream, **app_options: Any) -> None:
        self.fake = fake
        self.upstream = upstream
        self.log = CompletionLog(tmp_path / "completions.sqlite")
        self.log.open()
        self.models = FakeModels(BASE, {"agent": 2})
        self.metrics = Metrics()
        self.engine = app_options.pop("engine", FakeEngine())
        self.app = build_app(
            upstream,
            self.log,
            models=self.models,
            engine=self.engine,
            metrics=self.metrics,
            **app_options,
        )
        self.http = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://localhost")

    @classmethod
    async def start(cls, tmp_path: Path, **app_options: Any) -> Proxy:
        fake = FakeVLLM()
        return cls(tmp_path, fake, await fake.start(), **app_options)

    async def chat(self, path: str = "/t/traj-1/v1/chat/completions", **body: Any) -> httpx.Response:
        return await self.http.post(path, json={"model": "agent", "messages": MESSAGES} | body)

    async def close(self) -> None:
        await self.http.aclose()
        await self.upstream.aclose()
        await self.fake.stop()
        self.log.close()


@pytest.fixture
async def proxy(tmp_path: Path) -> AsyncIterator[Proxy]:
    running = await Proxy.start(tmp_path)
    yield running
    await running.close()


async def test_trajectory_chat_completion_is_recorded_and_cleaned(proxy: Proxy) -> None:
    response = await proxy.chat(n=2, temperature=1.0)
    assert response.status_code == 200
    payload = response.json()
    assert payload["model"] == "agent@2"
    assert [c["logprobs"] for c in payload["choices"]] == [None, None]
    assert "prompt_token_ids" not in payload and all("token_ids" not in c for c in payload["choices"])

    forwarded = proxy.fake.requests[-1]
    assert (
        forwarded["model"] == "agent@2"
        and forwarded["logprobs"] is True
        and forwarded["return_token_ids"] is True
    )

    rows = await proxy.log.get("traj-1")
    assert [(r.choice_index, r.request_id) for r in rows] == [(0, "chatcmpl-fake"), (1, "chatcmpl-fake")]
    assert rows[1].logprobs == [fake_logprob(1, k) for k in range(len(OUTPUT_IDS))]
    assert rows[0].request == {"model": "agent", "messages": MESSAGES, "n": 2, "temperature": 1.0}
    assert rows[0].latency_seconds >= 0 and rows[0].finish_reason == "stop"

    trajectory = (await proxy.http.get("/v1/trajectories/traj-1")).json()
    assert trajectory["trajectory_id"] == "traj-1" and len(trajectory["completions"]) == 2
    assert (await proxy.http.get("/t/traj-1/v1/trajectory")).json() == trajectory


async def test_plain_route_records_nothing_and_forces_nothing(proxy: Proxy) -> None:
    response = await proxy.chat("/v1/chat/completions", model=BASE, logprobs=True)
    assert response.status_code == 200
    assert response.json()["choices"][0]["logprobs"]["content"][0]["token"] == "The"  # asked for: kept
    assert "return_token_ids" not in proxy.fake.requests[-1]
    assert (await proxy.http.get("/v1/trajectories/traj-1")).status_code == 404


async def test_completions_endpoint(proxy: Proxy) -> None:
    response = await proxy.http.post("/t/traj-2/v1/completions", json={"model": "agent@1", "prompt": "2+2="})
    assert response.status_code == 200
    assert response.json()["choices"][0] == {
        "index": 0,
        "text": TEXT,
        "logprobs": None,
        "finish_reason": "stop",
    }
    (row,) = await proxy.log.get("traj-2")
    assert (row.endpoint, row.served_model, row.step) == ("completions", "agent@1", 1)
    assert row.prompt_token_ids == PROMPT_IDS and row.output_token_ids == OUTPUT_IDS


async def test_stream_is_rewritten_and_recorded_before_done(proxy: Proxy) -> None:
    chunks: list[dict[str, Any]] = []
    async with proxy.http.stream(
        "POST",
        "/t/traj-3/v1/chat/completions",
        json={"model": "agent", "messages": MESSAGES, "n": 2, "stream": True},
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line async for line in response.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [orjson.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert all(c["model"] == "agent@2" and "prompt_token_ids" not in c and "usage" not in c for c in chunks)
    for index in (0, 1):
        text = "".join(
            c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"][0]["index"] == index
        )
        assert text == TEXT
    rows = await proxy.log.get("traj-3")
    assert [r.output_token_ids for r in rows] == [OUTPUT_IDS, OUTPUT_IDS]
    assert rows[0].logprobs == [fake_logprob(0, k) for k in range(len(OUTPUT_IDS))]
    assert proxy.models.leased == []  # the adapter lease ends with the stream
    exposition = (await proxy.http.get("/metrics")).text
    assert 'artlike_completion_tokens_total{endpoint="chat.completions"} 12.0' in exposition
    assert "artlike_time_to_first_token_seconds_count" in exposition
    assert 'route="/t/{trajectory_id}/v1/chat/completions",status="200"' in exposition


async def test_stream_usage_is_kept_when_asked(proxy: Proxy) -> None:
    response = await proxy.chat(stream=True, stream_options={"include_usage": True})
    events = [line for line in response.text.split("\n\n") if line]
    usage = orjson.loads(events[-2].removeprefix("data: "))
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(OUTPUT_IDS)


async def run_sse(stream: ProxyStream, disconnect_after_events: int) -> list[bytes]:
    """Serve `stream` as the ASGI server would, with a client that hangs up after some SSE events."""
    bodies: list[bytes] = []
    hang_up = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await hang_up.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            bodies.append(message["body"])
            if b"".join(bodies).count(b"data: ") >= disconnect_after_events:
                hang_up.set()

    await SSEResponse(stream)({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send)
    return bodies


async def test_client_disconnect_aborts_the_engine_and_records_what_was_generated(proxy: Proxy) -> None:
    proxy.fake.stall_after_events = 4  # role chunk + 3 tokens, then the "engine" keeps generating
    serving = OpenAIServing(
        engine=proxy.engine,
        upstream=proxy.upstream,
        models=proxy.models,
        log=proxy.log,
        metrics=proxy.metrics,
        settings=Settings(),
    )
    body = orjson.dumps({"model": "agent", "messages": MESSAGES, "stream": True})
    stream = await serving.create_completion("chat.completions", body, "traj-4")
    assert isinstance(stream, ProxyStream) and proxy.models.leased == ["agent@2"]
    await asyncio.wait_for(run_sse(stream, disconnect_after_events=4), timeout=10)

    # the upstream connection was dropped: vLLM aborts
    await asyncio.wait_for(proxy.fake.stream_closed.wait(), timeout=10)
    assert proxy.fake.closed_streams == 1 and proxy.models.leased == []
    rows = await asyncio.wait_for(_rows_when_present(proxy.log, "traj-4"), timeout=10)
    assert [(r.output_token_ids, r.finish_reason) for r in rows] == [(OUTPUT_IDS[:3], "abort")]
    assert rows[0].logprobs == [fake_logprob(0, k) for k in range(3)]


async def test_cancelled_request_aborts_the_engine(proxy: Proxy) -> None:
    """A non-streamed request whose client goes away (the router cancels it) drops the engine connection."""
    proxy.fake.stall_after_events = 0
    serving = OpenAIServing(
        engine=proxy.engine,
        upstream=proxy.upstream,
        models=proxy.models,
        log=proxy.log,
        metrics=proxy.metrics,
        settings=Settings(),
    )
    body = orjson.dumps({"model": "agent", "messages": MESSAGES})
    request = asyncio.ensure_future(serving.create_completion("chat.completions", body, "traj-6"))
    await asyncio.wait_for(proxy.fake.stalled.wait(), timeout=10)
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request
    await asyncio.wait_for(proxy.fake.stream_closed.wait(), timeout=10)
    assert proxy.fake.closed_streams == 1 and proxy.models.leased == []
    proxy.fake.stall_after_events = None
    assert (await proxy.chat()).status_code == 200  # the pool recovered


async def _rows_when_present(log: CompletionLog, trajectory_id: str) -> list[Any]:
    # The partial row is submitted without awaiting (the request task may be cancelled); a later
    # record() in FIFO order is committed after it, so one round-trip through the writer suffices.
    marker = context("marker")
    trace = CompletionTrace("chat.completions")
    trace.add(vllm_chat_response())
    await log.record(trace.records(marker))
    return await log.get(trajectory_id)


async def test_engine_breaking_mid_stream_ends_the_stream_with_an_error(proxy: Proxy) -> None:
    proxy.fake.break_after_events = 3
    response = await proxy.chat("/t/traj-5/v1/chat/completions", stream=True)
    events = [e for e in response.text.split("\n\n") if e]
    error = orjson.loads(events[-1].removeprefix("data: "))
    assert error["error"]["type"] == "service_unavailable_error"
    rows = await _rows_when_present(proxy.log, "traj-5")
    assert [(r.output_token_ids, r.finish_reason) for r in rows] == [(OUTPUT_IDS[:2], "abort")]


async def test_engine_not_ready_is_503_with_retry_after(tmp_path: Path) -> None:
    proxy = await Proxy.start(tmp_path, engine=FakeEngine(state="restarting", retry_seconds=12))
    try:
        response = await proxy.chat()
        assert response.status_code == 503 and response.headers["retry-after"] == "12"
        assert response.json()["error"]["code"] == "engine_restarting"
        assert proxy.fake.requests == []
    finally:
        await proxy.close()


async def test_engine_unreachable_is_503(tmp_path: Path) -> None:
    """Nothing listening (the engine is down), or a connection closed without an answer (it crashed)."""
    fake = FakeVLLM()
    upstream = await fake.start()
    await fake.stop()
    refused = Proxy(tmp_path / "refused", fake, upstream)
    dropped = await Proxy.start(tmp_path / "dropped")
    dropped.fake.disconnect = True
    try:
        for proxy in (refused, dropped):
            for stream in (False, True):
                response = await proxy.chat(stream=stream)
                assert response.status_code == 503 and response.headers["retry-after"] == "7"
                assert response.json()["error"]["type"] == "service_unavailable_error"
            assert proxy.models.leased == []
    finally:
        await refused.close()
        await dropped.close()


async def test_engine_errors_pass_through(proxy: Proxy) -> None:
    proxy.fake.error = (400, b'{"error":{"message":"bad n","type":"BadRequestError","param":"n","code":400}}')
    for stream in (False, True):
        response = await proxy.chat(stream=stream)
        assert response.status_code == 400
        assert response.json() == {
            "error": {"message": "bad n", "type": "invalid_request_error", "param": "n", "code": None}
        }
    assert await proxy.log.get("traj-1") == []


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/t/bad.id/v1/chat/completions", {}, 400, "trajectory_id"),
        ("/t/-x/v1/chat/completions", {}, 400, "trajectory_id"),
        ("/t/ok/v1/chat/completions", {"model": "nobody"}, 404, "model"),
        ("/t/ok/v1/chat/completions", {"model": "agent@9"}, 404, "model"),
        ("/t/ok/v1/chat/completions", {"use_beam_search": True}, 400, "use_beam_search"),
        ("/v1/chat/completions", {"n": 0}, 400, "n"),
    ],
)
async def test_request_errors(proxy: Proxy, path: str, body: dict[str, Any], status: int, param: str) -> None:
    response = await proxy.chat(path, **body)
    assert response.status_code == status
    assert response.json()["error"]["param"] == param
    assert proxy.fake.requests == []


async def test_echo_is_refused_on_trajectory_completions(proxy: Proxy) -> None:
    response = await proxy.http.post(
        "/t/ok/v1/completions", json={"model": "agent", "prompt": "x", "echo": True}
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "echo"


async def test_malformed_json(proxy: Proxy) -> None:
    for content in (b"{not json", b"[1, 2]", b""):
        response = await proxy.http.post("/t/ok/v1/chat/completions", content=content)
        assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"


async def test_seed_policy(tmp_path: Path) -> None:
    rejecting = await Proxy.start(tmp_path / "a", settings=Settings(reject_seed=True))
    forwarding = await Proxy.start(tmp_path / "b")
    try:
        response = await rejecting.chat(seed=1)
        assert response.status_code == 400
        error = response.json()["error"]
        assert (error["param"], error["code"]) == ("seed", "unsupported_parameter")
        assert "crash the engine" in error["message"]
        assert (await forwarding.chat(seed=1)).status_code == 200
        assert forwarding.fake.requests[-1]["seed"] == 1
    finally:
        await rejecting.close()
        await forwarding.close()


async def test_a_completion_that_cannot_be_recorded_is_an_error(proxy: Proxy) -> None:
    proxy.log.close()
    response = await proxy.chat()
    assert response.status_code == 500
    assert response.json()["error"]["code"] == "completion_not_recorded"
    assert "artlike_completion_log_failures_total" in proxy.metrics.render().decode()


async def test_models_list(proxy: Proxy) -> None:
    for path in ("/v1/models", "/t/traj-1/v1/models"):
        listing = (await proxy.http.get(path)).json()
        assert listing["object"] == "list"
        assert [m["id"] for m in listing["data"]] == [BASE, "agent", "agent@0", "agent@1", "agent@2"]
        assert all(m["object"] == "model" and isinstance(m["created"], int) for m in listing["data"])
    assert (await proxy.http.get("/t/bad.id/v1/models")).status_code == 400


async def test_unknown_trajectory_is_404(proxy: Proxy) -> None:
    response = await proxy.http.get("/v1/trajectories/never-seen")
    assert response.status_code == 404 and response.json()["error"]["code"] == "trajectory_not_found"
    assert (await proxy.http.get("/v1/trajectories/bad.id")).status_code == 400


@pytest.mark.parametrize(("path", "expected"), [
    ("/v1/chat/completions", ("/v1/chat/completions", "chat.completions", None)),
    ("/v1/completions", ("/v1/completions", "completions", None)),
    ("/t/run-7/v1/chat/completions", ("/t/{trajectory_id}/v1/chat/completions", "chat.completions", "run-7")),
    ("/t/run-7/v1/completions", ("/t/{trajectory_id}/v1/completions", "completions", "run-7")),
    ("/v1/responses", ("/v1/responses", "responses", None)),
    ("/t/run-7/v1/messages", ("/t/{trajectory_id}/v1/messages", "messages", "run-7")),
    ("/t//v1/chat/completions", None),  # no id: left to the router (404), as `{trajectory_id}` would not match
    ("/t/run-7/v1/models", None),
    ("/t/a/b/v1/chat/completions", None),
    ("/v1/chat/completions/", None),
    ("/v2/chat/completions", None),
])
def test_completion_paths_are_matched_like_the_routes(path: str, expected: tuple[str, str, str | None] | None) -> None:
    match = match_completion_path(path)
    route = None if match is None else match[1].endpoint or match[1].dialect
    assert (None if match is None else (match[0].path, route, match[2])) == expected
    if match is not None:
        assert match[0] == RouteTemplate(expected[0])  # type: ignore[index]


def test_api_router_doctests() -> None:
    assert doctest.testmod(api_router, raise_on_error=True).attempted >= 1


async def test_other_methods_on_a_completion_path_get_the_routers_405(proxy: Proxy) -> None:
    for path in ("/v1/chat/completions", "/t/traj-1/v1/completions"):
        response = await proxy.http.get(path)
        assert response.status_code == 405
        assert response.json()["error"]["type"] == "invalid_request_error"
    assert (await proxy.http.post("/t//v1/chat/completions", json={})).status_code == 404


async def test_n_over_the_recorded_choices_limit_is_a_400_naming_n(tmp_path: Path) -> None:
    proxy = await Proxy.start(tmp_path, settings=Settings(max_recorded_choices=2))
    try:
        response = await proxy.chat(n=3)
        assert response.status_code == 400
        error = response.json()["error"]
        assert (error["param"], error["code"]) == ("n", "too_many_choices")
        assert not proxy.fake.requests  # refused before the engine generated anything
        assert (await proxy.chat("/v1/chat/completions", n=3)).status_code == 200  # not recorded: no limit
        assert (await proxy.chat(n=2)).status_code == 200
    finally:
        await proxy.close()


async def test_delete_trajectory_is_204_then_404(proxy: Proxy) -> None:
    assert (await proxy.chat()).status_code == 200
    assert (await proxy.chat("/t/other/v1/chat/completions")).status_code == 200

    assert (await proxy.http.delete("/v1/trajectories/traj-1")).status_code == 204

    assert (await proxy.http.get("/v1/trajectories/traj-1")).status_code == 404
    assert (await proxy.http.get("/v1/trajectories/other")).status_code == 200
    response = await proxy.http.delete("/v1/trajectories/traj-1")
    assert response.status_code == 404
    assert (response.json()["error"]["param"], response.json()["error"]["code"]) == (
        "trajectory_id", "trajectory_not_found")
    assert (await proxy.http.delete("/v1/trajectories/bad.id")).status_code == 400


def test_nulls_the_openai_schema_does_not_allow_are_dropped_and_real_values_kept() -> None:
    # vLLM 0.32's chat response: `annotations: null`, `function_call: null`, `completion_tokens_details: null`;
    # the OpenAI schema has them as an array and objects that may be absent, not null.
    _, asked = prepare_upstream_body("chat.completions", {"model": "m", "messages": MESSAGES}, "m", record=True)
    message = {"role": "assistant", "content": "4", "refusal": None, "annotations": None, "function_call": None,
               "tool_calls": []}
    usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4, "prompt_tokens_details": None,
             "completion_tokens_details": None}
    payload = {"model": "m", "choices": [{"index": 0, "message": message, "logprobs": None}], "usage": usage}
    rewrite_response(payload, asked, "m")
    assert payload["choices"][0]["message"] == {"role": "assistant", "content": "4", "refusal": None,
                                                "tool_calls": []}
    assert payload["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    kept = {"model": "m", "choices": [{"index": 0, "message": {"content": "x", "annotations": [{"type": "a"}]}}],
            "usage": {"completion_tokens_details": {"reasoning_tokens": 0}}}
    rewrite_response(kept, asked, "m")
    assert kept["choices"][0]["message"]["annotations"] == [{"type": "a"}]
    assert kept["usage"] == {"completion_tokens_details": {"reasoning_tokens": 0}}


@pytest.mark.parametrize("role", ["wizard", None, 3])
def test_an_unknown_message_role_is_a_400_naming_it(role: Any) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": role, "content": "abracadabra"}]
    with pytest.raises(InvalidRequest) as caught:
        validate_request("chat.completions", {"model": "m", "messages": messages})
    assert caught.value.param == "messages[1].role" and repr(role) in caught.value.message
    for known in ("system", "developer", "user", "assistant", "tool"):
        message = {"role": known, "content": "x"} | ({"tool_call_id": "c1"} if known == "tool" else {})
        validate_request("chat.completions", {"model": "m", "messages": [message]})


CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "tool", "content": "18C"}, "messages[1].tool_call_id"),
        ({"role": "tool", "tool_call_id": 7, "content": "18C"}, "messages[1].tool_call_id"),
        ({"role": "tool", "tool_call_id": "c1"}, "messages[1].content"),
        ({"role": "user"}, "messages[1].content"),
        ({"role": "user", "content": 5}, "messages[1].content"),
        ({"role": "assistant", "content": None, "tool_calls": {"id": "c1"}}, "messages[1].tool_calls"),
        ({"role": "assistant", "tool_calls": [{"id": "c1", "type": "function"}]}, "messages[1].tool_calls[0].function"),
        ({"role": "assistant", "tool_calls": [CALL, {**CALL, "function": {"arguments": "{}"}}]},
         "messages[1].tool_calls[1].function.name"),
        ({"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": {}}}]},
         "messages[1].tool_calls[0].function.arguments"),
        ({"role": "assistant", "tool_calls": [{**CALL, "id": None}]}, "messages[1].tool_calls[0].id"),
        ({"role": "assistant", "tool_calls": [{**CALL, "type": "custom"}]}, "messages[1].tool_calls[0].type"),
        ({"role": "user", "content": [{"type": "txt", "text": "hi"}]}, "messages[1].content[0].type"),
        ({"role": "user", "content": ["hi"]}, "messages[1].content[0]"),
        ({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text"}]}, "messages[1].content[1].text"),
        ({"role": "user", "content": [{"type": "image_url"}]}, "messages[1].content[0].image_url"),
        ({"role": "user", "content": [{"type": "image_url", "image_url": "http://x/y.png"}]},
         "messages[1].content[0].image_url"),
        ({"role": "user", "content": [{"type": "image_url", "image_url": {}}]}, "messages[1].content[0].image_url.url"),
        ({"role": "system", "content": [{"type": "image_url", "image_url": {"url": "u"}}]},
         "messages[1].content[0].type"),
        ({"role": "assistant", "content": [{"type": "refusal"}]}, "messages[1].content[0].refusal"),
    ],
)
def test_a_malformed_message_is_a_400_naming_the_field(message: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        validate_request("chat.completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}, message]})
    assert (caught.value.param, caught.value.code) == (param, "invalid_value")
    assert param in caught.value.message


def test_well_formed_tool_turns_and_content_parts_pass() -> None:
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": [{"type": "text", "text": "look"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]},
        {"role": "assistant", "content": None, "tool_calls": [CALL, {**CALL, "id": "c2"}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18C"},
        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "20C"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "done"}], "tool_calls": None},
        {"role": "assistant", "content": "", "tool_calls": []},
    ]
    validate_request("chat.completions", {"model": "m", "messages": messages})
