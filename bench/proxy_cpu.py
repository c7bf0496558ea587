"""The proxy's CPU cost per request, and what one bare Python HTTP hop costs on the same machine.

    python -m bench.proxy_cpu [--requests 200] [--stream-requests 30]

Latency ratios on a shared 2-core VM are noisy; CPU time is not. One `artlike serve` with a known engine
port; sequential 1-token chat completions sent straight to vLLM, through the proxy, and through a
trajectory URL (recorded), alternating request by request. For each, the CPU seconds the proxy process
(all its threads; vLLM is a separate process) used per request. The floor: a trivial Starlette endpoint
under uvicorn, called with httpx from the same process, CPU per request for both sides together. Then
streamed requests of a fixed length (`ignore_eos`), direct and through the proxy, alternating: the proxy's
CPU per streamed chunk, which on a machine whose cores the engine also uses is taken from the engine.
Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import psutil
import uvicorn
from artlike_server.launcher import ServerProcess, free_port
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bench.machine import machine

# vLLM requires a key on every route; a fixed one (--engine-api-key) lets this bench call it directly.
ENGINE_KEY = secrets.token_urlsafe(24)
ENGINE_HEADERS = {"Authorization": f"Bearer {ENGINE_KEY}"}
_BODY = b'{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"Hi"}}]}'


def _cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


async def alternate(server: ServerProcess, urls: dict[str, str], body: dict[str, Any], *, requests: int,
                    warm_up: int) -> dict[str, dict[str, float]]:
    """Send `body` to each URL in turn, `requests` rounds after `warm_up` uncounted ones; per target the
    proxy process's CPU ms per request and the p50 latency. A URL may hold "{tid}" (a fresh trajectory id)."""
    assert server.process is not None
    proxy = psutil.Process(server.process.pid)
    cpu = {target: 0.0 for target in urls}
    latency: dict[str, list[float]] = {target: [] for target in urls}
    # The proxy runs without a key; vLLM requires its own on every route (see main), sent to both.
    async with httpx.AsyncClient(timeout=120, headers=ENGINE_HEADERS) as client:
        for index in range(warm_up + requests):
            for target, url in urls.items():
                before, started = _cpu_seconds(proxy), time.perf_counter()
                # streamed or not, the whole body is read before the clock stops
                async with client.stream("POST", url.format(tid=uuid.uuid4().hex), json=body) as response:
                    response.raise_for_status()
                    await response.aread()
                if index >= warm_up:
                    latency[target].append(time.perf_counter() - started)
                    cpu[target] += _cpu_seconds(proxy) - before
    return {target: {"proxy_cpu_ms_per_request": cpu[target] / requests * 1000,
                     "p50_ms": statistics.median(latency[target]) * 1000} for target in urls}


def _urls(server: ServerProcess, engine_port: int) -> dict[str, str]:
    return {
        "direct": f"http://127.0.0.1:{engine_port}/v1/chat/completions",
        "proxy": f"{server.base_url}/v1/chat/completions",
        "proxy+record": f"{server.base_url}/t/{{tid}}/v1/chat/completions",
    }


async def proxy_cpu(server: ServerProcess, engine_port: int, requests: int) -> dict[str, dict[str, float]]:
    """Sequential 1-token chat completions: direct, proxied, recorded."""
    body = {"model": server.model_id, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
            "temperature": 0.0}
    return await alternate(server, _urls(server, engine_port), body, requests=requests, warm_up=5)


async def proxy_stream_cpu(server: ServerProcess, engine_port: int, requests: int,
                           tokens: int) -> dict[str, dict[str, float]]:
    """Proxy CPU per streamed request of `tokens` chunks, straight to vLLM and through the proxy."""
    urls = {target: url for target, url in _urls(server, engine_port).items() if target != "proxy+record"}
    body = {"model": server.model_id, "messages": [{"role": "user", "content": "Tell me a story."}],
            "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True, "stream": True}
    result = await alternate(server, urls, body, requests=requests, warm_up=1)
    added = result["proxy"]["proxy_cpu_ms_per_request"] - result["direct"]["proxy_cpu_ms_per_request"]
    result["proxy"]["added_cpu_ms_per_chunk"] = added / tokens
    return result


def bare_hop_cpu(requests: int) -> float:
    """CPU ms per request of a trivial Starlette endpoint plus its httpx caller, both in this process."""

    async def answer(request: Request) -> Response:
        await request.body()
        return Response(_BODY, media_type="application/json")

    port = free_port()
    app = Starlette(routes=[Route("/v1/chat/completions", answer, methods=["POST"])])
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    me = psutil.Process()
    with httpx.Client() as client:
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        for _ in range(50):
            client.post(url, json={"a": 1})
        before = _cpu_seconds(me)
        for _ in range(requests):
            client.post(url, json={"a": 1})
        spent = _cpu_seconds(me) - before
    server.should_exit = True
    thread.join()
    return spent / requests * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200, help="per target")
    parser.add_argument("--stream-requests", type=int, default=30, help="streamed requests per target")
    parser.add_argument("--stream-tokens", type=int, default=32, help="chunks per streamed request")
    parser.add_argument("--output", type=Path, default=Path("bench/results/proxy_cpu.json"))
    args = parser.parse_args()

    floor = bare_hop_cpu(args.requests * 5)
    engine_port = free_port()
    with ServerProcess(Path(tempfile.mkdtemp(prefix="artlike-bench-")),
                       args=["--engine-port", str(engine_port), "--engine-api-key", ENGINE_KEY]) as server:
        targets = asyncio.run(proxy_cpu(server, engine_port, args.requests))
        streamed = asyncio.run(proxy_stream_cpu(server, engine_port, args.stream_requests, args.stream_tokens))
    print(f"{'target':<13} {'proxy CPU ms/request':>21} {'p50 ms':>8}")
    for target, row in targets.items():
        print(f"{target:<13} {row['proxy_cpu_ms_per_request']:>21.2f} {row['p50_ms']:>8.1f}")
    for target, row in streamed.items():
        print(f"{target + ' stream':<13} {row['proxy_cpu_ms_per_request']:>21.2f} {row['p50_ms']:>8.1f}")
    print(f"\nstreamed, {args.stream_tokens} chunks: the proxy adds "
          f"{streamed['proxy']['added_cpu_ms_per_chunk']:.3f} CPU ms per chunk")
    print(f"bare Starlette endpoint + httpx caller, one process: {floor:.2f} CPU ms per request")
    report: dict[str, Any] = {"targets": targets, "streamed": streamed, "bare_hop_cpu_ms_per_request": floor,
                              "machine": machine(),
                              "config": {"requests": args.requests, "stream_requests": args.stream_requests,
                                         "stream_tokens": args.stream_tokens}}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    print(f"written {args.output}")


if __name__ == "__main__":
    main()
