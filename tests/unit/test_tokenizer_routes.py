"""The tokenizer routes (`/tokenizer_info`, `/tokenize`, `/detokenize`) in the real app over the base model's
tokenizer, in the shapes lm-evaluation-harness's remote tokenizer reads (vLLM's): ids that round-trip, the
special tokens and the served chat template."""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import cache
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from artlike_server.app import create_app
from artlike_server.default_model import ensure_default_model
from artlike_server.tokenizer import load_chat_tokenizer
from artlike_server.training.tokenizer_service import TokenizerService

from tests.unit.fake_services import fake_services

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@cache
def tokenizer() -> Any:
    return load_chat_tokenizer(ensure_default_model())


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    service = TokenizerService(tokenizer, TEMPLATE)
    app = create_app(fake_services(training=SimpleNamespace(tokenizer=service)))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as client:
        yield client


async def test_tokenize_and_detokenize_round_trip(http: httpx.AsyncClient) -> None:
    text = "Question: What is the capital of France?\nAnswer: Paris"
    response = await http.post("/tokenize", json={"prompt": text, "add_special_tokens": False, "model": "m@1"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["tokens"] == tokenizer().encode(text, add_special_tokens=False)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 4096
    detokenized = await http.post("/detokenize", json={"tokens": body["tokens"]})
    assert detokenized.json() == {"prompt": text}


async def test_tokenizer_info_names_the_special_tokens_and_the_served_template(http: httpx.AsyncClient) -> None:
    info = (await http.get("/tokenizer_info")).json()
    assert info["eos_token"] == tokenizer().eos_token == "<|im_end|>"
    assert info["chat_template"] == TEMPLATE
    assert info["vocab_size"] == len(tokenizer())


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {"prompt": 3}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/detokenize", {"tokens": [-1]}, "tokens.0"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
async def test_bad_bodies_name_the_parameter(http: httpx.AsyncClient, path: str, body: dict[str, Any],
                                             param: str) -> None:
    response = await http.post(path, json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param
