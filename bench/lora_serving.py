"""Rollout speed of LoRA serving against merged weights, on this machine, in one run.

    python -m bench.lora_serving [--quick] [--dtype auto|bfloat16|float32]

The policy a training loop samples from can be served two ways: as a LoRA adapter (`name@N`, how artlike
serves every step, many steps at once) or merged into the base weights (one policy per engine,
reloaded after every step). A merged model computes exactly what the base model computes, so its speed is
the base model's in an engine started *without* `--enable-lora` (which on CPU also keeps torch.compile).
Three rows, the same load each (C concurrent chat completions of T tokens, `ignore_eos`), straight to vLLM:

    lora-engine/base      the LoRA-enabled engine (artlike's), base model requests
    lora-engine/adapter   the same engine, requests to a rank-8 adapter on every linear layer (artlike's default)
    plain-engine/base     an engine without LoRA: what a merged-weights policy engine would run

and the price of a trainer-side merge per step: PEFT merge + save of the policy (artlike's policy engines
merge inside vLLM instead: `bench/policy_engine.py`). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
from artlike_server.default_model import DEFAULT_MODEL_ID, ensure_default_model
from artlike_server.engine.launch import EngineConfig, build_command, build_env, free_port

from bench.machine import machine

PROMPT = [{"role": "user", "content": "Write a short story about a lighthouse keeper and a storm."}]
KEY = secrets.token_urlsafe(16)
_LORA_FLAGS = {"--enable-lora": 0, "--max-lora-rank": 1, "--max-loras": 1}  # flag -> values after it


def plain_command(command: list[str]) -> list[str]:
    """`command` without the LoRA flags (and their values)."""
    out, skip = [], 0
    for arg in command:
        if skip:
            skip -= 1
            continue
        if arg in _LORA_FLAGS:
            skip = _LORA_FLAGS[arg]
            continue
        out.append(arg)
    return out


def make_adapter(model_dir: Path, out: Path) -> float:
    """A rank-8 adapter on every linear layer with non-zero weights; returns merge+save seconds."""
    import peft
    import torch
    from artlike_server.torch_worker.adapters import peft_lora_config
    from transformers import AutoModelForCausalLM

    from artlike.types import LoraConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    peft_model = peft.get_peft_model(model, peft_lora_config(LoraConfig(), str(model_dir)))
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.01)
    peft_model.save_pretrained(out / "adapter")
    started = time.perf_counter()
    merged = peft_model.merge_and_unload()
    merged.save_pretrained(out / "merged", safe_serialization=True)
    return time.perf_counter() - started


async def wait_healthy(url: str, process: Any) -> None:
    async with asyncio.timeout(600), httpx.AsyncClient() as http:
        while True:
            if process.returncode is not None:
                raise RuntimeError(f"vLLM exited with {process.returncode}")
            try:
                if (await http.get(f"{url}/health", timeout=5)).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(1)  # polling another process: nothing to await instead


async def load(url: str, model: str, concurrency: int, tokens: int, rounds: int) -> dict[str, float]:
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": model, "messages": PROMPT, "max_tokens": tokens, "temperature": 1.0, "ignore_eos": True}
    rates = []
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600) as http:
        await http.post("/v1/chat/completions", json=body | {"max_tokens": 4})  # warm
        for _ in range(rounds):
            started = time.perf_counter()
            answers = await asyncio.gather(*(http.post("/v1/chat/completions", json=body) for _ in range(concurrency)))
            seconds = time.perf_counter() - started
            generated = sum(a.json()["usage"]["completion_tokens"] for a in answers)
            rates.append(generated / seconds)
    return {"tokens_per_s": statistics.median(rates), "rounds": float(len(rates))}


@asynccontextmanager
async def running_engine(config: EngineConfig, command: list[str], env: dict[str, str]) -> AsyncIterator[None]:
    """vLLM started from `command`, healthy inside the block, its whole process group stopped after it."""
    log = open(config.log_path, "ab")  # noqa: SIM115, ASYNC230 - once per engine start; closed below
    process = await asyncio.create_subprocess_exec(*command, env=env, stdout=log, stderr=asyncio.subprocess.STDOUT,
                                                   start_new_session=True)
    try:
        await wait_healthy(config.base_url, process)
        yield
    finally:
        os.killpg(process.pid, 15)
        await process.wait()
        log.close()


async def run_engine(config: EngineConfig, *, lora: bool, jobs: list[tuple[str, str]], adapter: Path | None,
                     concurrency: int, tokens: int, rounds: int) -> dict[str, dict[str, float]]:
    command = build_command(config)
    if not lora:
        command = plain_command(command)
    async with running_engine(config, command, build_env(config, os.environ, api_key=KEY)):
        if adapter is not None:
            async with httpx.AsyncClient(base_url=config.base_url, headers={"Authorization": f"Bearer {KEY}"}) as http:
                response = await http.post("/v1/load_lora_adapter", json={"lora_name": "policy",
                                                                          "lora_path": str(adapter)}, timeout=120)
                response.raise_for_status()
        return {row: await load(config.base_url, model, concurrency, tokens, rounds) for row, model in jobs}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = ensure_default_model()
    work = Path(tempfile.mkdtemp(prefix="lora-serving-"))
    merge_seconds = await asyncio.to_thread(make_adapter, model_dir, work)
    dtype = args.dtype
    if dtype == "auto":
        from artlike_server.dtype_choice import choose_dtypes
        dtype = choose_dtypes({"engine": "auto"}, "cpu")["engine"].dtype
    rows: dict[str, dict[str, float]] = {}
    for lora in (True, False):
        config = EngineConfig(model_path=model_dir, served_model_name=DEFAULT_MODEL_ID, port=free_port(),
                              log_path=work / f"engine-{'lora' if lora else 'plain'}.log", dtype=dtype)
        jobs = [("lora-engine/base", DEFAULT_MODEL_ID), ("lora-engine/adapter", "policy")] if lora else \
            [("plain-engine/base", DEFAULT_MODEL_ID)]
        rows |= await run_engine(config, lora=lora, jobs=jobs, adapter=work / "adapter" if lora else None,
                                 concurrency=args.concurrency, tokens=args.tokens, rounds=args.rounds)
    adapter = rows["lora-engine/adapter"]["tokens_per_s"]
    return {
        "machine": machine(),
        "dtype": dtype, "concurrency": args.concurrency, "tokens": args.tokens, "rounds": args.rounds,
        "rows": rows,
        "merged_over_lora": rows["plain-engine/base"]["tokens_per_s"] / adapter,
        "base_in_lora_engine_over_lora": rows["lora-engine/base"]["tokens_per_s"] / adapter,
        "merge_and_save_seconds": merge_seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 round of 16 x 32 tokens")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "lora_serving.json")
    args = parser.parse_args()
    if args.quick:
        args.concurrency, args.tokens, args.rounds = 16, 32, 1
    result = asyncio.run(main_async(args))
    print(f"{'row':<22} {'tokens/s':>10}   ({result['concurrency']} concurrent x {result['tokens']} tokens, "
          f"{result['dtype']}, median of {result['rounds']} rounds)")
    for row, values in result["rows"].items():
        print(f"{row:<22} {values['tokens_per_s']:>10.1f}")
    print(f"merged (plain engine) / LoRA adapter: {result['merged_over_lora']:.2f}x; "
          f"base in the LoRA engine / adapter: {result['base_in_lora_engine_over_lora']:.2f}x; "
          f"PEFT merge + save: {result['merge_and_save_seconds']:.2f} s")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
