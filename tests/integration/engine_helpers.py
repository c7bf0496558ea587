"""Helpers for the tests that drive a real vLLM engine: a LoRA adapter that really changes the model,
and a look at which engine processes are alive."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
from artlike_server.launcher import ServerProcess


def make_lora_adapter(
    base_model: Path, out_dir: Path, *, seed: int, rank: int = 8, scale: float = 0.05
) -> Path:
    """Save a PEFT LoRA adapter (q/v projections) whose B matrices are seeded random, not PEFT's zeros,
    so the adapter changes outputs. Loadable by vLLM and PEFT."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
    peft_model.save_pretrained(out_dir)
    return out_dir


def engine_processes(api_server_pid: int) -> list[psutil.Process]:
    """The vLLM API server and every process below it (EngineCore, worker, helpers)."""
    server = psutil.Process(api_server_pid)
    return [server, *server.children(recursive=True)]


def still_running(processes: list[psutil.Process]) -> list[psutil.Process]:
    """Those of `processes` that still run: not gone, not a zombie, not a new process reusing the pid."""
    alive = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
        except psutil.NoSuchProcess:
            continue
    return alive


@dataclass(frozen=True)
class EngineConnection:
    """The shared server's own vLLM engine, reached directly (to compare the proxy with vLLM's routes)."""

    base_url: str
    headers: dict[str, str]


def engine_connection(server: ServerProcess) -> EngineConnection:
    """The engine's latest start: its port from the command line the supervisor logs, its per-start key from
    its environment (readable by this same user; never on its command line)."""
    log = (Path(server.data_dir) / "logs" / "engine.log").read_text()
    port = int(re.findall(r"starting vLLM: .* --port (\d+)", log)[-1])
    health = httpx.get(f"{server.base_url}/health", headers=server.headers, timeout=30).json()
    key = psutil.Process(health["engine"]["pid"]).environ()["VLLM_API_KEY"]
    return EngineConnection(f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {key}"})


async def engine_tokens(http: httpx.AsyncClient, model: str, messages: list[dict[str, Any]], *,
                        generation_prompt: bool) -> list[int]:
    """The engine's own tokenization of a conversation with the served chat template (`http`: the engine;
    `model`: the base model, always loaded: adapters share its tokenizer)."""
    reply = await http.post("/tokenize", json={"model": model, "messages": messages,
                                                "add_generation_prompt": generation_prompt})
    reply.raise_for_status()
    return list(reply.json()["tokens"])


async def served_logprobs(http: httpx.AsyncClient, model: str, token_ids: list[int]) -> list[float | None]:
    """The served `model`'s logprob of each token given the ones before it (None for the first): the
    engine's prompt logprobs through the artlike server (`http`), which loads the step if it was evicted."""
    reply = await http.post("/v1/completions", json={"model": model, "prompt": token_ids, "max_tokens": 1,
                                                     "temperature": 0, "prompt_logprobs": 0})
    reply.raise_for_status()
    scored = reply.json()["choices"][0]["prompt_logprobs"]
    return [None if entry is None else entry[str(token)]["logprob"] for token, entry in zip(token_ids, scored, strict=True)]
