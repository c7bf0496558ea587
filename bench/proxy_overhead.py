"""Proxy overhead: the same load sent straight to vLLM and through the artlike proxy, in one run.

    python -m bench.proxy_overhead [--quick]

One `artlike serve` is started with a known engine port, so "direct" and "proxy" hit the very same
vLLM process; rounds alternate the targets to cancel drift on a shared machine:
    direct           straight to vLLM
    proxy            through the proxy, not recorded
    direct+fields    straight to vLLM, asking for what recording forces (logprobs, token ids)
    proxy+record     through a trajectory URL: recorded
    direct-responses, proxy-responses, proxy+record-responses    the same for `/v1/responses` (vLLM's own
    direct-messages,  proxy-messages,  proxy+record-messages     route vs ours, translated to chat completions)
"proxy+record / direct+fields" is the proxy's own cost when recording; "direct+fields / direct" is what
the engine spends on the fields a recorded completion needs.
Scenarios: 1, 8 and 32 concurrent requests, streaming and not, fixed-length outputs (`ignore_eos`), plus
a latency probe of sequential 1-token requests, alternating targets request by request (the added p50
latency, the median of per-pair differences). Throughput ratios are the median over rounds of the paired
per-round ratio. On a shared VM both pairings matter: a slow second slows both sides of a pair instead of
whichever target ran in it. Prints a table, writes JSON.
Targets: proxy throughput ≥ 97% of direct, added p50 latency ≤ 2 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import secrets
import statistics
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
import orjson
from artlike_server.launcher import ServerProcess, free_port

from bench.machine import machine

PROMPT = [{"role": "user", "content": "Write a short story about a lighthouse keeper and a storm."}]

# vLLM requires a key on every route; a fixed one (--engine-api-key) lets this bench call it directly.
ENGINE_KEY = secrets.token_urlsafe(24)
ENGINE_HEADERS = {"Authorization": f"Bearer {ENGINE_KEY}"}


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
    round_tokens_per_s: list[float] = field(default_factory=list)  # one per round, paired across targets
    latencies_ms: list[float] = field(default_factory=list)  # latency probe: one per pair, paired across targets


RECORDED_FIELDS = {"logprobs": True, "return_token_ids": True}


Api = Literal["chat", "responses", "messages"]
PATHS: dict[Api, str] = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}


@dataclass(frozen=True)
class Target:
    url: str  # may hold "{tid}": a fresh trajectory id per load
    extra: dict[str, Any] = field(default_factory=dict)  # request fields added to the common body
    api: Api = "chat"


def request_body(api: Api, model: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    """The same generation in each API's shape (greedy, fixed length: vLLM's `ignore_eos` on every route)."""
    common = {"model": model, "temperature": 0.0, "ignore_eos": True, "stream": stream}
    if api == "responses":
        return {**common, "input": PROMPT[0]["content"], "max_output_tokens": max_tokens, "store": False}
    if api == "messages":
        return {**common, "messages": PROMPT, "max_tokens": max_tokens}
    body = {**common, "messages": PROMPT, "max_tokens": max_tokens}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _usage_tokens(api: Api, event: dict[str, Any]) -> int | None:
    """Output tokens, from a whole answer or from the stream event that carries them."""
    if api == "chat":
        return event["usage"]["completion_tokens"] if event.get("usage") else None
    if api == "responses":
        response = event.get("response", event)
        usage = response.get("usage") if isinstance(response, dict) else None
        return usage["output_tokens"] if usage else None
    usage = event.get("usage")  # messages: the whole message, or `message_delta` (cumulative output tokens)
    return usage["output_tokens"] if usage and "output_tokens" in usage else None


def _has_text(api: Api, event: dict[str, Any]) -> bool:
    if api == "chat":
        return bool(event.get("choices") and event["choices"][0].get("delta", {}).get("content"))
    if api == "responses":
        return event.get("type") == "response.output_text.delta"
    return event.get("type") == "content_block_delta"


async def one_request(client: httpx.AsyncClient, target: Target, model: str, max_tokens: int,
                      stream: bool) -> Sample:
    url = target.url.format(tid=uuid.uuid4().hex)
    body = {**request_body(target.api, model, max_tokens, stream), **target.extra}
    started = time.perf_counter()
    ttft = None
    tokens = 0
    if not stream:
        response = await client.post(url, content=orjson.dumps(body), headers={"content-type": "application/json"})
        response.raise_for_status()
        tokens = _usage_tokens(target.api, response.json()) or 0
    else:
        async with client.stream("POST", url, content=orjson.dumps(body),
                                 headers={"content-type": "application/json"}) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = orjson.loads(line[6:])
                if ttft is None and _has_text(target.api, event):
                    ttft = time.perf_counter() - started
                tokens = _usage_tokens(target.api, event) or tokens
    return Sample(time.perf_counter() - started, ttft, tokens)


async def load(client: httpx.AsyncClient, target: Target, model: str, *, concurrency: int, requests: int,
               max_tokens: int, stream: bool) -> tuple[float, list[Sample]]:
    limit = asyncio.Semaphore(concurrency)

    async def bounded() -> Sample:
        async with limit:
            return await one_request(client, target, model, max_tokens, stream)

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
    engine = f"http://127.0.0.1:{engine_port}"
    targets = {
        "direct": Target(engine + PATHS["chat"]),
        "proxy": Target(server.base_url + PATHS["chat"]),
        "direct+fields": Target(engine + PATHS["chat"], RECORDED_FIELDS),
        "proxy+record": Target(f"{server.base_url}/t/{{tid}}{PATHS['chat']}"),
    }
    # The translated APIs: vLLM's own route (direct) against ours, plain and recorded.
    for api in args.apis:
        targets[f"direct-{api}"] = Target(engine + PATHS[api], api=api)
        targets[f"proxy-{api}"] = Target(server.base_url + PATHS[api], api=api)
        targets[f"proxy+record-{api}"] = Target(f"{server.base_url}/t/{{tid}}{PATHS[api]}", api=api)
    results: list[Result] = []
    # keep-alive shorter than the servers' 5 s, so no request goes out on a connection being closed
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256, keepalive_expiry=2.0)
    # The proxy runs without a key; vLLM requires its own on every route (see main), sent to both.
    async with httpx.AsyncClient(timeout=600, limits=limits, headers=ENGINE_HEADERS) as client:
        for target in targets.values():  # warm every path once (compiles, connection pools)
            await one_request(client, target, server.model_id, 4, False)

        for concurrency in args.concurrency:
            for stream in (False, True):
                requests = max(concurrency, args.min_requests)
                per_target: dict[str, list[tuple[float, list[Sample]]]] = {t: [] for t in targets}
                # Unmeasured: the engine's first batches of a new shape are slower (kernel selection).
                await load(client, targets["direct"], server.model_id, concurrency=concurrency,
                           requests=requests, max_tokens=args.max_tokens, stream=stream)
                for round_index in range(args.rounds):
                    # every round runs each target once, back to back, starting from a different one
                    order = list(targets)[round_index % len(targets):] + list(targets)[:round_index % len(targets)]
                    for name in order:
                        per_target[name].append(await load(
                            client, targets[name], server.model_id, concurrency=concurrency,
                            requests=requests, max_tokens=args.max_tokens, stream=stream))
                for name, runs in per_target.items():
                    wall = sum(w for w, _ in runs)
                    samples = [s for _, ss in runs for s in ss]
                    results.append(summarise("throughput", name, concurrency, stream, wall, samples))
                    results[-1].round_tokens_per_s = [sum(s.tokens for s in ss) / w for w, ss in runs]
                    print(_row(results[-1]), flush=True)

        # Added latency: sequential 1-token requests, alternating targets request by request.
        samples_by_target: dict[str, list[Sample]] = {t: [] for t in targets}
        for _ in range(args.latency_requests):
            for name, target in targets.items():
                samples_by_target[name].append(await one_request(client, target, server.model_id, 1, False))
        for name, samples in samples_by_target.items():
            wall = sum(s.seconds for s in samples)
            results.append(summarise("latency-1tok", name, 1, False, wall, samples))
            results[-1].latencies_ms = [sample.seconds * 1000 for sample in samples]
            print(_row(results[-1]), flush=True)
    return {"results": [asdict(r) for r in results], "summary": _ratios(results)}


def _row(r: Result) -> str:
    ttft = f"{r.ttft_p50_ms:8.1f}" if r.ttft_p50_ms is not None else f"{'-':>8}"
    return (f"{r.scenario:<13} {r.target:<22} {r.concurrency:>4} {'yes' if r.stream else 'no':>6} "
            f"{r.tokens_per_s:>9.1f} {r.p50_ms:>9.1f} {r.p99_ms:>9.1f} {ttft}")


COMPARISONS = (("proxy", "direct"), ("proxy+record", "direct+fields"), ("direct+fields", "direct"),
               ("proxy+record", "direct"),
               *((f"proxy-{api}", f"direct-{api}") for api in ("responses", "messages")),
               *((f"proxy+record-{api}", f"direct-{api}") for api in ("responses", "messages")))
"""(target, baseline): the proxy's cost plain and recording, the engine's cost of the recorded fields, the
whole cost of recording; for the Responses and Messages APIs, ours (translated to chat completions) against
vLLM's own route, plain and recorded."""


def median_interval(values: list[float], *, confidence: float = 0.95, resamples: int = 2000,
                    seed: int = 0) -> tuple[float, float]:
    """A percentile-bootstrap confidence interval for the median of `values` (paired ratios or differences).

    >>> median_interval([1.0, 1.0, 1.0])
    (1.0, 1.0)
    """
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    tail = (1 - confidence) / 2
    return medians[int(tail * (resamples - 1))], medians[int((1 - tail) * (resamples - 1))]


def _ratios(results: list[Result]) -> list[dict[str, Any]]:
    by_key = {(r.scenario, r.concurrency, r.stream, r.target): r for r in results}
    summary = []
    for (scenario, concurrency, stream, target), r in by_key.items():
        for compared, baseline in COMPARISONS:
            if compared != target:
                continue
            base = by_key[(scenario, concurrency, stream, baseline)]
            # The median of per-round ratios: a round's targets ran back to back, so a slow minute of the
            # shared VM slows both sides of a ratio instead of whichever target happened to run in it.
            paired = [t / b for t, b in zip(r.round_tokens_per_s, base.round_tokens_per_s, strict=True)]
            # Added latency: the median of per-pair differences (the two requests of a pair ran back to back).
            differences = [t - b for t, b in zip(r.latencies_ms, base.latencies_ms, strict=True)]
            summary.append({
                "scenario": scenario, "target": target, "baseline": baseline, "concurrency": concurrency,
                "stream": stream,
                "throughput_ratio": statistics.median(paired) if paired else r.tokens_per_s / base.tokens_per_s,
                "throughput_ratio_ci95": median_interval(paired) if paired else None,
                "round_ratios": paired,
                "added_p50_ms": statistics.median(differences) if differences else r.p50_ms - base.p50_ms,
                "added_p50_ms_ci95": median_interval(differences) if differences else None,
            })
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    parser.add_argument("--rounds", type=int, help="rounds per scenario (default 8; 2 with --quick)")
    parser.add_argument("--max-tokens", type=int, help="tokens per request (default 32; 16 with --quick)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32], help="loads to run")
    parser.add_argument("--apis", nargs="*", default=["responses", "messages"], choices=["responses", "messages"],
                        help="translated APIs compared with vLLM's own routes (default both)")
    parser.add_argument("--output", type=Path, default=Path("bench/results/proxy_overhead.json"))
    args = parser.parse_args()
    args.min_requests = 2  # per round and target (at least the concurrency)
    args.rounds = args.rounds or (2 if args.quick else 8)
    args.max_tokens = args.max_tokens or (16 if args.quick else 32)
    args.latency_requests = 20 if args.quick else 200

    engine_port = free_port()
    data_dir = Path(tempfile.mkdtemp(prefix="artlike-bench-"))
    print(f"{'scenario':<13} {'target':<22} {'conc':>4} {'stream':>6} {'tok/s':>9} {'p50 ms':>9} "
          f"{'p99 ms':>9} {'ttft ms':>8}")
    with ServerProcess(data_dir, args=["--engine-port", str(engine_port), "--engine-api-key", ENGINE_KEY]) as server:
        report = asyncio.run(run(args, server, engine_port))
    print("\nratios (same engine, same run):")
    print(f"{'scenario':<13} {'target / baseline':<44} {'conc':>4} {'stream':>6} {'tput ratio':>10} "
          f"{'95% CI':>11} {'rounds min-max':>14} {'+p50 ms':>8} {'95% CI':>11}")
    for s in report["summary"]:
        pair = f"{s['target']} / {s['baseline']}"
        spread = f"{min(s['round_ratios']):.2f}-{max(s['round_ratios']):.2f}" if s["round_ratios"] else "-"
        ratio_ci = "{:.3f}-{:.3f}".format(*s["throughput_ratio_ci95"]) if s["throughput_ratio_ci95"] else "-"
        latency_ci = "{:.2f}-{:.2f}".format(*s["added_p50_ms_ci95"]) if s["added_p50_ms_ci95"] else "-"
        print(f"{s['scenario']:<13} {pair:<44} {s['concurrency']:>4} {'yes' if s['stream'] else 'no':>6} "
              f"{s['throughput_ratio']:>10.3f} {ratio_ci:>11} {spread:>14} {s['added_p50_ms']:>8.2f} "
              f"{latency_ci:>11}")
    report["machine"] = machine()
    report["config"] = {k: v for k, v in vars(args).items() if k != "output"}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    print(f"\nwritten {args.output}")


if __name__ == "__main__":
    main()
