"""`bench/fake_vllm.py` answers in vLLM 0.32's shapes, and the proxy records through it token-exact.

The fake runs as a subprocess on a free port, as the scale bench starts it (a few seconds in all)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from artlike_server.completion_log import CompletionLog
from artlike_server.engine.upstream import Upstream
from artlike_server.launcher import free_port

from bench.fake_vllm import DEFAULT_MODEL, EOS, encode
from tests.unit.openai_fakes import FakeModels, build_app

KEY = "fake-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MESSAGES = [{"role": "user", "content": "What is 2+2?"}]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fake() -> Iterator[str]:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "bench.fake_vllm", "--port", str(port), "--api-key", KEY,
                                "--name", "engine-a", "--tokens", "5"], cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 15
        while True:
            assert process.poll() is None, process.stderr.read() if process.stderr else b""
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the fake did not start"
            time.sleep(0.05)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)


def sse_events(text: str) -> list[dict[str, Any]]:
    events = [line[6:] for line in text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [orjson.loads(event) for event in events[:-1]]


def test_key_is_required_except_for_health(fake: str) -> None:
    assert httpx.get(f"{fake}/health").status_code == 200
    denied = httpx.get(f"{fake}/v1/models")
    assert denied.status_code == 401 and denied.json() == {"error": "Unauthorized"}
    assert httpx.get(f"{fake}/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_chat_completion_in_vllm_shape(fake: str) -> None:
    response = httpx.post(f"{fake}/v1/chat/completions", headers=AUTH, json={
        "model": DEFAULT_MODEL, "messages": MESSAGES, "n": 2, "logprobs": True, "top_logprobs": 2,
        "return_token_ids": True})
    assert response.status_code == 200 and response.headers["x-fake-engine"] == "engine-a"
    payload = response.json()
    assert payload["object"] == "chat.completion" and payload["system_fingerprint"] == "engine-a"
    assert payload["prompt_token_ids"][-len(encode("assistant\n")):] == encode("assistant\n")
    assert len(payload["choices"]) == 2
    for choice in payload["choices"]:
        ids, content = choice["token_ids"], choice["logprobs"]["content"]
        assert len(ids) == len(content) == 6 and ids[-1] == EOS  # 5 tokens, then the sampled EOS
        assert choice["finish_reason"] == "stop" and len(choice["message"]["content"]) == 5
        assert all(len(entry["top_logprobs"]) == 2 and entry["logprob"] < 0 for entry in content)
    assert payload["choices"][0]["token_ids"] != payload["choices"][1]["token_ids"]
    assert payload["usage"]["completion_tokens"] == 12

    plain = httpx.post(f"{fake}/v1/chat/completions", headers=AUTH, json={
        "model": DEFAULT_MODEL, "messages": MESSAGES, "max_tokens": 3}).json()
    choice = plain["choices"][0]
    assert choice["finish_reason"] == "length" and choice["token_ids"] is None and choice["logprobs"] is None
    assert plain["prompt_token_ids"] is None


def test_streamed_completion_and_prompt_logprobs(fake: str) -> None:
    response = httpx.post(f"{fake}/v1/completions", headers=AUTH, json={
        "model": DEFAULT_MODEL, "prompt": "Hello", "max_tokens": 4, "ignore_eos": True, "logprobs": 0,
        "return_token_ids": True, "stream": True, "stream_options": {"include_usage": True}})
    assert response.headers["content-type"].startswith("text/event-stream")
    chunks = sse_events(response.text)
    assert chunks[0]["choices"][0]["prompt_token_ids"] == encode("Hello")
    tokens = [c["choices"][0] for c in chunks if c["choices"]]
    assert [len(c["token_ids"]) for c in tokens] == [1, 1, 1, 1] and tokens[-1]["finish_reason"] == "length"
    assert all(len(c["logprobs"]["token_logprobs"]) == 1 for c in tokens)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4

    scored = httpx.post(f"{fake}/v1/completions", headers=AUTH, json={
        "model": DEFAULT_MODEL, "prompt": [10, 11, 12], "max_tokens": 1, "prompt_logprobs": 0}).json()
    entries = scored["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and entries[2]["12"]["logprob"] < 0  # how EngineClient.token_logprobs reads it


def test_adapters_load_list_and_unload(fake: str) -> None:
    load = httpx.post(f"{fake}/v1/load_lora_adapter", headers=AUTH, json={"lora_name": "agent@1",
                                                                         "lora_path": "/tmp/agent/1"})
    assert load.status_code == 200 and "added successfully" in load.text
    again = httpx.post(f"{fake}/v1/load_lora_adapter", headers=AUTH, json={"lora_name": "agent@1",
                                                                          "lora_path": "/tmp/agent/1"})
    assert again.status_code == 400
    cards = httpx.get(f"{fake}/v1/models", headers=AUTH).json()["data"]
    assert [(c["id"], c["root"], c["parent"]) for c in cards] == [
        (DEFAULT_MODEL, DEFAULT_MODEL, None), ("agent@1", "/tmp/agent/1", DEFAULT_MODEL)]
    served = httpx.post(f"{fake}/v1/chat/completions", headers=AUTH, json={"model": "agent@1", "messages": MESSAGES})
    assert served.status_code == 200 and served.json()["model"] == "agent@1"
    assert httpx.post(f"{fake}/v1/unload_lora_adapter", headers=AUTH, json={"lora_name": "agent@1"}).status_code == 200
    assert httpx.post(f"{fake}/v1/unload_lora_adapter", headers=AUTH, json={"lora_name": "agent@1"}).status_code == 404
    missing = httpx.post(f"{fake}/v1/chat/completions", headers=AUTH, json={"model": "agent@1", "messages": MESSAGES})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


@pytest.fixture
async def proxy(fake: str, tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, CompletionLog]]:
    upstream = Upstream(fake)
    upstream.set_api_key(KEY)
    log = CompletionLog(tmp_path / "completions.sqlite")
    log.open()
    app = build_app(upstream, log, models=FakeModels(DEFAULT_MODEL))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as client:
        yield client, log
    await upstream.aclose()
    log.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_the_proxy_records_through_the_fake(proxy: tuple[httpx.AsyncClient, CompletionLog],
                                                  stream: bool) -> None:
    client, log = proxy
    response = await client.post("/t/traj-fake/v1/chat/completions",
                                 json={"model": DEFAULT_MODEL, "messages": MESSAGES, "n": 2, "stream": stream})
    assert response.status_code == 200, response.text
    texts = ([c["message"]["content"] for c in response.json()["choices"]] if not stream else
             ["".join(c["choices"][0]["delta"].get("content", "") for c in sse_events(response.text)
                      if c["choices"] and c["choices"][0]["index"] == i) for i in range(2)])
    rows = await log.get("traj-fake")
    assert [row.choice_index for row in rows] == [0, 1]
    for row, text in zip(rows, texts, strict=True):
        assert row.output_token_ids[-1] == EOS and row.output_token_ids[:-1] == encode(text)
        assert len(row.logprobs) == len(row.output_token_ids) and row.finish_reason == "stop"
        assert row.prompt_token_ids[-len(encode("assistant\n")):] == encode("assistant\n")


async def test_the_proxy_records_completions_through_the_fake(proxy: tuple[httpx.AsyncClient, CompletionLog]) -> None:
    client, log = proxy
    response = await client.post("/t/traj-text/v1/completions", json={
        "model": DEFAULT_MODEL, "prompt": "Once", "max_tokens": 3, "stream": True})
    assert response.status_code == 200, response.text
    text = "".join(c["choices"][0]["text"] for c in sse_events(response.text) if c["choices"])
    [row] = await log.get("traj-text")
    assert row.prompt_token_ids == encode("Once") and row.output_token_ids == encode(text)
    assert row.finish_reason == "length" and len(row.logprobs) == 3
