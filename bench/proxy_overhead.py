"""Proxy overhead: the same load sent straight to vLLM and through the artlike proxy, in one run.

    python -m bench.proxy_overhead [--quick]

One `artlike serve` is started with a known engine port, so "direct" and "proxy" hit the very same
vLLM process; rounds alternate direct / proxy / proxy+record to cancel drift on a shared machine.
Scenarios: 1, 8 and 32 concurrent requests, streaming and not, fixed-length outputs (`ignore_eos`), plus
a latency probe of sequential 1-token requests (the added p50 latency). Prints a table, writes JSON.
Targets: proxy throughput ≥ 97% of direct, added p50 latency ≤ 2 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
from artlike_server.launcher import ServerProcess, free_port

PROMPT = [{"role": "user", "content": "Write a short story about a lighthouse keeper and a storm."}]


@dataclass
class Sample:
    seconds: float
    ttft: float | None
    tokens: int


@dataclass
class Result:
    scenario: str
    target: str
    concurrency: int
    stream: bool
    requests: int
    tokens_per_s: float
    p50_ms: float
    p99_ms: float
    ttft_p50_ms: float | None


async def one_request(client: httpx.AsyncClient, url: str, model: str, max_tokens: int, stream: bool) -> Sample:
    body = {"model": model, "messages": PROMPT, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    started = time.perf_counter()
    ttft = None
    tokens = 0
    if not stream:
        response = await client.post(url, content=orjson.dumps(body), headers={"content-type": "application/json"})
        response.raise_for_status()
        tokens = response.json()["usage"]["completion_tokens"]
    else:
        async with client.stream("POST", url, content=orjson.dumps(body),
                                 headers={"content-type": "application/json"}) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = orjson.loads(line[6:])
                if ttft is None and chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                    ttft = time.perf_counter() - started
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    return Sample(time.perf_counter() - started, ttft, tokens)


async def load(client: httpx.AsyncClient, url: str, model: str, *, concurrency: int, requests: int,
               max_tokens: int, stream: bool) -> tuple[float, list[Sample]]:
    limit = asyncio.Semaphore(concurrency)

    async def bounded() -> Sample:
        async with limit:
            return await one_request(client, url, model, max_tokens, stream)

    started = time.perf_counter()
    samples = await asyncio.gather(*(bounded() for _ in range(requests)))
    return time.perf_counter() - started, list(samples)


def summarise(scenario: str, target: str, concurrency: int, stream: bool, wall: float,
              samples: list[Sample]) -> Result:
    latencies = sorted(s.seconds * 1000 for s in samples)
    ttfts = [s.ttft * 1000 for s in samples if s.ttft is not None]
    p99_index = min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))
    return Result(scenario, target, concurrency, stream, len(samples), sum(s.tokens for s in samples) / wall,
                  statistics.median(latencies), latencies[p99_index], statistics.median(ttfts) if ttfts else None)


async def run(args: argparse.Namespace, server: ServerProcess, engine_port: int) -> dict[str, Any]:
    targets = {
        "direct": f"http://127.0.0.1:{engine_port}/v1/chat/completions",
        "proxy": f"{server.base_url}/v1/chat/completions",
        "proxy+record": f"{server.base_url}/t/{{tid}}/v1/chat/completions",
    }
    results: list[Result] = []
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        for url in targets.values():  # warm every path once (compiles, connection pools)
            await one_request(client, url.format(tid=uuid.uuid4().hex), server.model_id, 4, False)

        for concurrency in args.concurrency:
            for stream in (False, True):
                requests = concurrency * args.requests_per_slot
                per_target: dict[str, list[tuple[float, list[Sample]]]] = {t: [] for t in targets}
                for _ in range(args.rounds):
                    for target, url in targets.items():
                        per_target[target].append(await load(
                            client, url.format(tid=uuid.uuid4().hex), server.model_id, concurrency=concurrency,
                            requests=requests, max_tokens=args.max_tokens, stream=stream))
                for target, runs in per_target.items():
                    wall = sum(w for w, _ in runs)
                    samples = [s for _, ss in runs for s in ss]
                    results.append(summarise("throughput", target, concurrency, stream, wall, samples))
                    print(_row(results[-1]), flush=True)

        # Added latency: sequential 1-token requests, alternating targets request by request.
        samples_by_target: dict[str, list[Sample]] = {t: [] for t in targets}
        for _ in range(args.latency_requests):
            for target, url in targets.items():
                samples_by_target[target].append(
                    await one_request(client, url.format(tid=uuid.uuid4().hex), server.model_id, 1, False))
        for target, samples in samples_by_target.items():
            wall = sum(s.seconds for s in samples)
            results.append(summarise("latency-1tok", target, 1, False, wall, samples))
            print(_row(results[-1]), flush=True)
    return {"results": [asdict(r) for r in results], "summary": _ratios(results)}


def _row(r: Result) -> str:
    ttft = f"{r.ttft_p50_ms:8.1f}" if r.ttft_p50_ms is not None else f"{'-':>8}"
    return (f"{r.scenario:<13} {r.target:<13} {r.concurrency:>4} {'yes' if r.stream else 'no':>6} "
            f"{r.tokens_per_s:>9.1f} {r.p50_ms:>9.1f} {r.p99_ms:>9.1f} {ttft}")


def _ratios(results: list[Result]) -> list[dict[str, Any]]:
    by_key = {(r.scenario, r.concurrency, r.stream, r.target): r for r in results}
    summary = []
    for (scenario, concurrency, stream, target), r in by_key.items():
        if target == "direct":
            continue
        direct = by_key[(scenario, concurrency, stream, "direct")]
        summary.append({
            "scenario": scenario, "target": target, "concurrency": concurrency, "stream": stream,
            "throughput_ratio": r.tokens_per_s / direct.tokens_per_s,
            "added_p50_ms": r.p50_ms - direct.p50_ms,
        })
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    parser.add_argument("--output", type=Path, default=Path("bench/results/proxy_overhead.json"))
    args = parser.parse_args()
    args.concurrency = [1, 8, 32]
    args.requests_per_slot = 1 if args.quick else 2
    args.rounds = 1 if args.quick else 2
    args.max_tokens = 32 if args.quick else 64
    args.latency_requests = 20 if args.quick else 100

    engine_port = free_port()
    data_dir = Path(tempfile.mkdtemp(prefix="artlike-bench-"))
    print(f"{'scenario':<13} {'target':<13} {'conc':>4} {'stream':>6} {'tok/s':>9} {'p50 ms':>9} "
          f"{'p99 ms':>9} {'ttft ms':>8}")
    with ServerProcess(data_dir, args=["--engine-port", str(engine_port)]) as server:
        report = asyncio.run(run(args, server, engine_port))
    print("\nratios (same engine, same run):")
    print(f"{'scenario':<13} {'target':<13} {'conc':>4} {'stream':>6} {'tput ratio':>10} {'+p50 ms':>8}")
    for s in report["summary"]:
        print(f"{s['scenario']:<13} {s['target']:<13} {s['concurrency']:>4} {'yes' if s['stream'] else 'no':>6} "
              f"{s['throughput_ratio']:>10.3f} {s['added_p50_ms']:>8.2f}")
    report["machine"] = {"platform": platform.platform(), "python": platform.python_version()}
    report["config"] = {k: v for k, v in vars(args).items() if k != "output"}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    print(f"\nwritten {args.output}")


if __name__ == "__main__":
    main()
