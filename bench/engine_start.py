"""How long the vLLM engine takes to start on CPU, three ways, in one run.

    python -m bench.engine_start [--starts N]

vLLM's API server process starts an engine-core process, which either spawns a worker process that runs
the model (vLLM's multiproc executor, its default on CPU) or runs the model itself (its uniproc executor,
with VLLM_ENABLE_V1_MULTIPROCESSING=0). vLLM-CPU spawns the engine core as a fresh interpreter; artlike's
`artlike_core_fork` plugin forks it from the API server instead (engine/fork_plugin.py). Every row starts
the engine exactly as artlike does (`engine/launch.py`: same command line, same thread binding), differing
only in these variables:

    worker-process     VLLM_ENABLE_V1_MULTIPROCESSING=1, ARTLIKE_ENGINE_CORE_START=spawn
    in-engine-core     VLLM_ENABLE_V1_MULTIPROCESSING=0, ARTLIKE_ENGINE_CORE_START=spawn
    forked-core        VLLM_ENABLE_V1_MULTIPROCESSING=0, ARTLIKE_ENGINE_CORE_START=fork (artlike's default on CPU)

Per row, each the median of N starts (alternating rows, so that a busy moment of the machine hits all):
seconds from the command to a healthy /health, and generation throughput (C concurrent completions of T
tokens, `ignore_eos`); and whether the greedy text of the same prompts (first start) is identical. Prints a
table, writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from artlike_server.default_model import DEFAULT_MODEL_ID, ensure_default_model
from artlike_server.engine.fork_plugin import START_ENV as CORE_START_ENV
from artlike_server.engine.launch import EngineConfig, build_command, build_env, free_port

from bench.lora_serving import KEY, running_engine
from bench.machine import machine

# row -> (VLLM_ENABLE_V1_MULTIPROCESSING, ARTLIKE_ENGINE_CORE_START)
ROWS = {"worker-process": ("1", "spawn"), "in-engine-core": ("0", "spawn"), "forked-core": ("0", "fork")}
GREEDY_PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time")


async def generate(url: str, prompt: str, tokens: int, temperature: float) -> tuple[str, int]:
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=600) as http:
        answer = (await http.post("/v1/completions", json={
            "model": DEFAULT_MODEL_ID, "prompt": prompt, "max_tokens": tokens, "temperature": temperature,
            "ignore_eos": True})).json()
    return answer["choices"][0]["text"], answer["usage"]["completion_tokens"]


async def start_once(config: EngineConfig, variables: tuple[str, str], *, measure: bool, concurrency: int,
                     tokens: int) -> dict[str, Any]:
    multiprocessing, core_start = variables
    env = build_env(config, {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": multiprocessing,
                             CORE_START_ENV: core_start}, api_key=KEY)
    started = time.perf_counter()
    async with running_engine(config, build_command(config), env):
        result: dict[str, Any] = {"start_seconds": time.perf_counter() - started}
        if measure:
            result["greedy"] = [(await generate(config.base_url, p, 32, 0.0))[0] for p in GREEDY_PROMPTS]
        await generate(config.base_url, "Warm up.", 4, 1.0)
        began = time.perf_counter()
        answers = await asyncio.gather(*(generate(config.base_url, f"Story {i}:", tokens, 1.0)
                                         for i in range(concurrency)))
        result["tokens_per_s"] = sum(n for _, n in answers) / (time.perf_counter() - began)
        return result


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = ensure_default_model()
    work = Path(tempfile.mkdtemp(prefix="engine-start-"))
    starts: dict[str, list[dict[str, Any]]] = {row: [] for row in ROWS}
    for attempt in range(args.starts):
        for row, variables in ROWS.items():
            config = EngineConfig(model_path=model_dir, served_model_name=DEFAULT_MODEL_ID, port=free_port(),
                                  log_path=work / f"engine-{row}.log", dtype="float32")
            starts[row].append(await start_once(config, variables, measure=attempt == 0,
                                                concurrency=args.concurrency, tokens=args.tokens))
    rows = {row: {"start_seconds": statistics.median(s["start_seconds"] for s in runs),
                  "starts": [round(s["start_seconds"], 2) for s in runs],
                  "tokens_per_s": statistics.median(s["tokens_per_s"] for s in runs),
                  "throughputs": [round(s["tokens_per_s"], 1) for s in runs]} for row, runs in starts.items()}
    return {
        "machine": machine(), "dtype": "float32", "concurrency": args.concurrency, "tokens": args.tokens,
        "rows": rows,
        "start_ratio": rows["in-engine-core"]["start_seconds"] / rows["worker-process"]["start_seconds"],
        "throughput_ratio": rows["in-engine-core"]["tokens_per_s"] / rows["worker-process"]["tokens_per_s"],
        "fork_start_ratio": rows["forked-core"]["start_seconds"] / rows["in-engine-core"]["start_seconds"],
        "fork_throughput_ratio": rows["forked-core"]["tokens_per_s"] / rows["in-engine-core"]["tokens_per_s"],
        "same_greedy_text": all(runs[0]["greedy"] == starts["worker-process"][0]["greedy"]
                                for runs in starts.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--starts", type=int, default=3, help="starts per row (the median is reported)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "engine_start.json")
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    print(f"{'row':<16} {'start s':>8} {'tokens/s':>9}   (medians of {args.starts} starts; "
          f"{result['concurrency']} concurrent x {result['tokens']} tokens)")
    for row, values in result["rows"].items():
        print(f"{row:<16} {values['start_seconds']:>8.1f} {values['tokens_per_s']:>9.1f}")
    print(f"start in-engine-core / worker-process: {result['start_ratio']:.2f}x; throughput: "
          f"{result['throughput_ratio']:.2f}x")
    print(f"start forked-core / in-engine-core: {result['fork_start_ratio']:.2f}x; throughput: "
          f"{result['fork_throughput_ratio']:.2f}x; same greedy text in every row: {result['same_greedy_text']}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
