"""Importing an adapter trained elsewhere: a LoRA made with PEFT on the embedded base in this test, imported with
`artlike import` through the session's server (`server` fixture), is listed and served at once as `name@0`,
and its greedy tokens equal PEFT + transformers' on the same prompt ids (both float32; the prompt ids are the
ones the server recorded, so the chat template the engine applied is not a second source of difference). A
refused adapter gets the OpenAI error shape from the real route, and a training step starts from the import."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest
import torch
from artlike_server.default_model import ensure_default_model
from artlike_server.launcher import ServerProcess
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

import artlike as art

from .helpers import http_client, openai_client, recorded, trainable_model

pytestmark = pytest.mark.integration

PROMPT = [{"role": "user", "content": "Name a colour."}]
MAX_TOKENS = 8
B_SCALE = 0.1  # large enough that the adapter changes the greedy text, small enough to stay language


@pytest.fixture(scope="module")
def peft_adapter(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PeftModel]:
    """A rank-4 q/v LoRA on the embedded base with random non-zero B (as a trained one has), saved by PEFT."""
    base = AutoModelForCausalLM.from_pretrained(str(ensure_default_model()), dtype=torch.float32)
    torch.manual_seed(0)
    model: Any = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 task_type="CAUSAL_LM"))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * B_SCALE)
    directory = tmp_path_factory.mktemp("trained-elsewhere") / "adapter"
    model.save_pretrained(str(directory))
    model.eval()
    return directory, model


def greedy_ids(model: Any, prompt_ids: list[int], tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             max_new_tokens=tokens, do_sample=False)
    return [int(t) for t in out[0, len(prompt_ids):]]


@pytest.fixture(scope="module")
async def imported(server: ServerProcess, peft_adapter: tuple[Path, PeftModel]) -> str:
    """The adapter imported with `artlike import` through the server, as a new model; its name."""
    name = f"imported-{uuid4().hex[:8]}"
    command = [sys.executable, "-m", "artlike", "import", str(peft_adapter[0]), name, "--server", server.base_url]
    env = {**os.environ, "ARTLIKE_API_KEY": server.api_key or ""}
    cli = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, timeout=300, env=env)
    assert cli.returncode == 0, cli.stderr
    assert f"as {name}@0" in cli.stderr
    return name


async def test_an_adapter_trained_elsewhere_is_served_at_once_as_peft_serves_it(
        server: ServerProcess, peft_adapter: tuple[Path, PeftModel], imported: str) -> None:
    _, model = peft_adapter
    name = imported

    with openai_client(server, timeout=120) as client:
        listed = {m.id for m in client.models.list()}
    assert {name, f"{name}@0"} <= listed

    trajectory = f"import-{uuid4().hex[:8]}"
    with openai_client(server, trajectory, timeout=300) as client:
        completion = client.chat.completions.create(model=f"{name}@0", messages=PROMPT,  # type: ignore[arg-type]
                                                    max_tokens=MAX_TOKENS, temperature=0.0)
    assert completion.choices[0].message.content
    row = recorded(server, trajectory)[-1]
    prompt_ids, served = row["prompt_token_ids"], row["output_token_ids"]
    assert served and len(served) <= MAX_TOKENS

    expected = await asyncio.to_thread(greedy_ids, model, prompt_ids, len(served))
    with model.disable_adapter():
        base_ids = await asyncio.to_thread(greedy_ids, model, prompt_ids, len(served))
    assert expected != base_ids, "the adapter must change the greedy text, or the comparison proves nothing"
    # Both sides run float32; the smallest top-2 logit gap of this prompt's greedy path is orders of magnitude
    # above the two kernels' rounding differences, so the tokens are equal, not merely close.
    assert served == expected


def test_a_refused_adapter_gets_the_openai_error_from_the_route(
        server: ServerProcess, peft_adapter: tuple[Path, PeftModel]) -> None:
    directory, _ = peft_adapter
    config = json.loads((directory / "adapter_config.json").read_text())
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for file_name, data in (("adapter_config.json", json.dumps({**config, "use_dora": True}).encode()),
                                ("adapter_model.safetensors", (directory / "adapter_model.safetensors").read_bytes())):
            info = tarfile.TarInfo(file_name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    name = f"refused-{uuid4().hex[:8]}"
    with http_client(server, timeout=60) as http:
        response = http.post(f"/v1/trainable_models/{name}/steps/import", content=buffer.getvalue(),
                             headers={"Content-Type": "application/x-tar"})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["param"], error["code"], error["type"]) == ("adapter_config.use_dora", "unsupported_adapter",
                                                                  "invalid_request_error")
        assert http.get(f"/v1/trainable_models/{name}").status_code == 404


async def test_training_continues_from_an_imported_step(server: ServerProcess, imported: str) -> None:
    model = trainable_model(server, imported, lora=art.LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"]))
    await model.register()  # the same LoRA as the import's: the imported model, as it is
    result = await model.train_sft([[*PROMPT, {"role": "assistant", "content": "Blue."}]], epochs=1, progress=False)
    assert result.trained and result.step == 1
    with openai_client(server, timeout=120) as client:
        assert f"{imported}@1" in {m.id for m in client.models.list()}
