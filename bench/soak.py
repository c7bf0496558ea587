"""Soak: one real server under sustained recorded streaming load while it trains, swaps, loses its engine
and its trainer, and is sent bad input — does it lose anything, and does it stay up?

    python -m bench.soak [--minutes 5] [--concurrency 64] [--quick]

Phases, one `artlike serve` (real vLLM engine, real trainer):
1. Event-loop probe: sequential 1-token requests while idle, then while a `/_train_model` request with
   64 offline trajectories (long messages: tokenization, batch writing) is being prepared. Target: p99
   while preparing ≤ 2× idle p99.
2. Soak (≥ 5 min): `--concurrency` clients each stream recorded chat completions through trajectory
   URLs, back to back; a trainer loop posts groups of finished trajectories to `/_train_model` (several
   steps, each one a hot swap); a battery of bad inputs runs throughout; at 1/3 of the time the engine is
   SIGKILLed, at 2/3 the trainer worker is SIGKILLed (mid-job when one runs).
3. Audit: every request that received `[DONE]` must have exactly its completion recorded, with as many
   output tokens as its `usage` said; the server must be healthy at the end.

Targets: 0 failed requests outside the engine-kill window (those inside get 503 + Retry-After, or lose their
connection), 0 lost completions, bad inputs answered 4xx in the OpenAI error shape, healthy at the end.
Prints a table, writes JSON (`bench/results/soak.json`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
from artlike_server.launcher import ServerProcess

from bench.machine import machine

API_KEY = "soak-key"
MODEL = "soak"
PROMPTS = ["Name a fruit.", "Say something about the sea.", "Give me a number.", "Describe a cat.",
           "What is the capital of France?", "Write a haiku about rain."]
GROUP_SIZE = 4


@dataclass
class Outcome:
    trajectory_id: str
    started: float
    seconds: float
    status: int  # HTTP status; 0: the connection failed
    done: bool  # the stream ended with [DONE]
    completion_tokens: int | None = None
    retry_after: str | None = None
    error: str | None = None


@dataclass
class Window:
    """When the engine was down: from the kill until /health answered 200 again."""

    start: float
    end: float | None = None

    def covers(self, outcome: Outcome, slack_s: float) -> bool:
        end = self.end if self.end is not None else float("inf")
        return outcome.started <= end + slack_s and outcome.started + outcome.seconds >= self.start - slack_s


@dataclass
class Report:
    machine: dict[str, Any] = field(default_factory=machine)
    minutes: float = 0.0
    concurrency: int = 0
    requests_sent: int = 0
    succeeded: int = 0
    failed_by_status: dict[str, int] = field(default_factory=dict)
    failed_outside_engine_kill: int = 0
    failed_inside_engine_kill: int = 0
    inside_kill_without_retry_after: int = 0
    completions_received: int = 0
    completions_recorded: int = 0
    lost_completions: int = 0
    token_count_mismatches: int = 0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    steps_committed: int = 0
    train_jobs: dict[str, int] = field(default_factory=dict)
    engine_restarts: int = 0
    engine_down_seconds: float | None = None
    trainer_killed_mid_job: bool = False
    bad_inputs: dict[str, int] = field(default_factory=dict)
    bad_input_failures: list[str] = field(default_factory=list)
    idle_probe_p99_ms: float = 0.0  # 1-token chat completions, one after another
    preparing_probe_p99_ms: float = 0.0
    preparing_probes: int = 0
    idle_loop_p99_ms: float = 0.0  # GET /v1/models: answered by the proxy alone, so it times its event loop
    preparing_loop_p99_ms: float = 0.0
    preparing_loop_probes: int = 0
    healthy_at_end: bool = False
    server_errors: list[str] = field(default_factory=list)  # the server log's ERROR/CRITICAL lines


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Soak:
    def __init__(self, server: ServerProcess, *, minutes: float, concurrency: int, max_tokens: int) -> None:
        self.server = server
        self.minutes = minutes
        self.concurrency = concurrency
        self.max_tokens = max_tokens
        self.http = httpx.AsyncClient(base_url=server.base_url, headers=server.headers,
                                      timeout=httpx.Timeout(300.0, connect=30.0),
                                      limits=httpx.Limits(max_connections=concurrency + 16))
        self.outcomes: list[Outcome] = []
        self.finished: list[Outcome] = []  # done, not yet posted for training
        self.report = Report(minutes=minutes, concurrency=concurrency)
        self.engine_window: Window | None = None
        self.stop = asyncio.Event()
        self.training = asyncio.Event()  # set while a /_train_model stream is open

    # ----------------------------------------------------------------------------- helpers

    async def health(self) -> dict[str, Any]:
        response = await self.http.get("/health", timeout=30)
        return dict(response.json())

    async def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if (await self.http.get("/health", timeout=10)).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(1)  # polling another process's health: nothing to await instead
        raise TimeoutError(f"server not healthy after {timeout_s:.0f}s")

    # ---------------------------------------------------------------------------- traffic

    async def one_stream(self) -> Outcome:
        trajectory_id = uuid.uuid4().hex
        body = {"model": MODEL, "messages": [{"role": "user", "content": random.choice(PROMPTS)}],
                "max_tokens": self.max_tokens, "temperature": 1.0, "stream": True,
                "stream_options": {"include_usage": True}}
        started = time.monotonic()
        outcome = Outcome(trajectory_id, started, 0.0, 0, False)
        try:
            async with self.http.stream("POST", f"/t/{trajectory_id}/v1/chat/completions", json=body) as response:
                outcome.status = response.status_code
                if response.status_code != 200:
                    outcome.retry_after = response.headers.get("retry-after")
                    outcome.error = (await response.aread())[:300].decode(errors="replace")
                else:
                    async for line in response.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        data = line[len("data: "):]
                        if data == "[DONE]":
                            outcome.done = True
                            break
                        chunk = orjson.loads(data)
                        if chunk.get("usage"):
                            outcome.completion_tokens = chunk["usage"]["completion_tokens"]
        except httpx.HTTPError as error:
            outcome.error = f"{type(error).__name__}: {error}"
        outcome.seconds = time.monotonic() - started
        return outcome

    async def client_loop(self) -> None:
        while not self.stop.is_set():
            outcome = await self.one_stream()
            self.outcomes.append(outcome)
            if outcome.done:
                self.finished.append(outcome)
            elif outcome.status in (0, 503):
                await asyncio.sleep(1.0)  # back off while the engine is away, as a client honouring Retry-After

    # ---------------------------------------------------------------------------- training

    async def train_once(self) -> None:
        take = (len(self.finished) // GROUP_SIZE) * GROUP_SIZE
        take = min(take, 4 * GROUP_SIZE)
        if take < 2 * GROUP_SIZE:
            return
        batch, self.finished = self.finished[:take], self.finished[take:]
        groups = [{"trajectories": [{"trajectory_id": o.trajectory_id, "reward": random.random()}
                                    for o in batch[i:i + GROUP_SIZE]]} for i in range(0, take, GROUP_SIZE)]
        kinds = self.report.train_jobs
        self.training.set()
        try:
            async with self.http.stream("POST", "/_train_model", json={"model": MODEL, "groups": groups},
                                        timeout=900) as response:
                if response.status_code != 200:
                    kinds[f"rejected_{response.status_code}"] = kinds.get(f"rejected_{response.status_code}", 0) + 1
                    return
                last: dict[str, Any] = {}
                async for line in response.aiter_lines():
                    if line:
                        last = orjson.loads(line)
                kind = str(last.get("type"))
                if kind == "error":
                    kind = f"error_{last.get('code')}"
                kinds[kind] = kinds.get(kind, 0) + 1
                if last.get("type") == "done":
                    self.report.steps_committed += 1
        except httpx.HTTPError as error:
            kinds[type(error).__name__] = kinds.get(type(error).__name__, 0) + 1
        finally:
            self.training.clear()

    async def train_loop(self) -> None:
        while not self.stop.is_set():
            await self.train_once()
            await asyncio.sleep(2)

    # ------------------------------------------------------------------------------- chaos

    async def kill_engine(self) -> None:
        pid = (await self.health())["engine"]["pid"]
        self.engine_window = Window(time.monotonic())
        os.kill(pid, signal.SIGKILL)
        # Back when /health says ready again (the supervisor restarts it and re-loads the adapters).
        await asyncio.sleep(2)
        await self.wait_healthy(600)
        self.engine_window.end = time.monotonic()
        self.report.engine_down_seconds = round(self.engine_window.end - self.engine_window.start, 1)

    async def kill_trainer(self) -> None:
        # Mid-job when one starts within a minute; otherwise an idle worker (the next job restarts it).
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.training.wait(), timeout=60)
        if self.training.is_set():
            await asyncio.sleep(3)  # let the job reach the worker
        pid = (await self.health())["trainer"]["pid"]
        if pid is not None:
            self.report.trainer_killed_mid_job = self.training.is_set()
            os.kill(pid, signal.SIGKILL)

    # -------------------------------------------------------------------------- bad inputs

    async def bad_inputs_once(self) -> None:
        """Each bad input must get a 4xx in the OpenAI error shape, never a 5xx or a dropped connection."""
        tid = uuid.uuid4().hex
        chat = f"/t/{tid}/v1/chat/completions"
        msg = [{"role": "user", "content": "hi"}]

        async def chunked_big() -> Any:
            for _ in range(34):
                yield b" " * (1 << 20)

        cases: list[tuple[str, str, str, dict[str, Any]]] = [
            ("malformed_json", "POST", chat, {"content": b"{not json"}),
            ("unknown_model", "POST", chat, {"json": {"model": "no-such-model", "messages": msg}}),
            ("malformed_step", "POST", chat, {"json": {"model": f"{MODEL}@\u00b2", "messages": msg}}),
            ("missing_step", "POST", chat, {"json": {"model": f"{MODEL}@99999", "messages": msg}}),
            ("bad_role", "POST", chat, {"json": {"model": MODEL, "messages": [{"role": 3, "content": "x"}]}}),
            ("too_many_choices", "POST", chat, {"json": {"model": MODEL, "messages": msg, "n": 100000}}),
            ("oversized_declared", "POST", chat, {"content": b" " * (33 << 20)}),
            ("oversized_chunked", "POST", "/_train_model", {"content": chunked_big(),
                                                             "headers": {"content-type": "application/json"}}),
            ("bad_trajectory_id", "POST", "/t/%20bad/v1/chat/completions", {"json": {"model": MODEL, "messages": msg}}),
            ("nan_reward", "POST", "/_train_model",
             {"content": b'{"model": "soak", "groups": [{"trajectories": [{"trajectory_id": "x", "reward": NaN}]}]}',
              "headers": {"content-type": "application/json"}}),
            ("unknown_trajectory", "POST", "/_train_model",
             {"json": {"model": MODEL, "groups": [{"trajectories": [{"trajectory_id": "nope1", "reward": 0.0},
                                                                    {"trajectory_id": "nope2", "reward": 1.0}]}]}}),
            ("bad_target_modules", "POST", "/v1/trainable_models",
             {"json": {"name": "soak-bad", "base_model": self.server.model_id,
                       "lora": {"rank": 8, "target_modules": ["embed_tokens"]}}}),
            ("wrong_key", "GET", "/v1/trainable_models", {"headers": {"authorization": "Bearer wrong"}}),
        ]
        for name, method, path, kwargs in cases:
            try:
                response = await self.http.request(method, path, **kwargs)
            except httpx.HTTPError as error:
                self.report.bad_input_failures.append(f"{name}: {type(error).__name__}: {error}")
                continue
            self.report.bad_inputs[name] = self.report.bad_inputs.get(name, 0) + 1
            in_kill = self.engine_window is not None and self.engine_window.end is None
            if response.status_code == 503 and in_kill:
                continue
            try:
                error_body = response.json()["error"]
                shaped = set(error_body) == {"message", "type", "param", "code"}
            except (ValueError, KeyError, TypeError):
                shaped = False
            if not (400 <= response.status_code < 500 and shaped):
                self.report.bad_input_failures.append(f"{name}: {response.status_code} {response.text[:200]}")

    async def bad_input_loop(self) -> None:
        while not self.stop.is_set():
            await self.bad_inputs_once()
            await asyncio.sleep(15)

    # ------------------------------------------------------------------------ event loop probe

    async def loop_probe_ms(self) -> float:
        started = time.perf_counter()
        (await self.http.get("/v1/models")).raise_for_status()
        return (time.perf_counter() - started) * 1000

    async def probe_ms(self) -> float:
        body = {"model": self.server.model_id, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
        started = time.perf_counter()
        response = await self.http.post("/v1/chat/completions", json=body)
        response.raise_for_status()
        return (time.perf_counter() - started) * 1000

    async def event_loop_probe(self, rounds: int = 5) -> None:
        """1-token requests back to back while idle, then while the server prepares a 64-trajectory train
        request (parse, tokenize, write the batch) — from the POST until its `start` line, `rounds` times."""
        idle = [await self.probe_ms() for _ in range(40)]
        idle_loop = [await self.loop_probe_ms() for _ in range(400)]
        words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "and", "keeps", "running",
                 "through", "the", "quiet", "field"]
        rng = random.Random(0)
        preparing: list[float] = []
        preparing_loop: list[float] = []
        for _ in range(rounds):
            # 8 groups of 8 offline trajectories; a group shares one ~600-word prompt (trained once per group).
            groups = []
            for _ in range(8):
                prompt = " ".join(rng.choices(words, k=600))
                groups.append({"trajectories": [
                    {"messages": [{"role": "user", "content": prompt},
                                  {"role": "assistant", "content": " ".join(rng.choices(words, k=30))}],
                     "reward": float(i % 2)} for i in range(8)]})
            prepared = asyncio.Event()

            async def post(body: dict[str, Any], prepared: asyncio.Event) -> None:
                # Read to the end: the job trains before the next round (or the soak) starts.
                try:
                    async with self.http.stream("POST", "/_train_model", json=body, timeout=1800) as response:
                        async for line in response.aiter_lines():
                            if line and orjson.loads(line)["type"] in ("start", "error", "done"):
                                prepared.set()
                finally:
                    prepared.set()

            poster = asyncio.create_task(post({"model": MODEL, "groups": groups,
                                               "config": {"learning_rate": 1e-6}}, prepared))

            async def probe(measure: Any, into: list[float], prepared: asyncio.Event) -> None:
                while not prepared.is_set():
                    into.append(await measure())

            await asyncio.gather(probe(self.probe_ms, preparing, prepared),
                                 probe(self.loop_probe_ms, preparing_loop, prepared))
            await poster
        self.report.idle_probe_p99_ms = round(percentile(idle, 0.99), 2)
        self.report.preparing_probe_p99_ms = round(percentile(preparing, 0.99), 2)
        self.report.preparing_probes = len(preparing)
        self.report.idle_loop_p99_ms = round(percentile(idle_loop, 0.99), 2)
        self.report.preparing_loop_p99_ms = round(percentile(preparing_loop, 0.99), 2)
        self.report.preparing_loop_probes = len(preparing_loop)

    # --------------------------------------------------------------------------------- run

    async def run(self) -> Report:
        await self.event_loop_probe()
        duration = self.minutes * 60
        began = time.monotonic()
        tasks = [asyncio.create_task(self.client_loop()) for _ in range(self.concurrency)]
        tasks += [asyncio.create_task(self.train_loop()), asyncio.create_task(self.bad_input_loop())]
        await asyncio.sleep(duration / 3)
        await self.kill_engine()
        await asyncio.sleep(max(0.0, began + 2 * duration / 3 - time.monotonic()))
        await self.kill_trainer()
        await asyncio.sleep(max(0.0, began + duration - time.monotonic()))
        self.stop.set()
        await asyncio.gather(*tasks)
        await self.audit()
        return self.report

    async def audit(self) -> None:
        r = self.report
        r.requests_sent = len(self.outcomes)
        done = [o for o in self.outcomes if o.done]
        r.succeeded = len(done)
        failed = [o for o in self.outcomes if not o.done]
        r.failed_by_status = dict(Counter(str(o.status) for o in failed))
        window = self.engine_window
        inside = [o for o in failed if window is not None and window.covers(o, slack_s=5.0)]
        r.failed_inside_engine_kill = len(inside)
        r.failed_outside_engine_kill = len(failed) - len(inside)
        r.inside_kill_without_retry_after = sum(1 for o in inside if o.status == 503 and not o.retry_after)
        latencies = [o.seconds * 1000 for o in done]
        r.p50_ms, r.p99_ms = round(percentile(latencies, 0.5), 1), round(percentile(latencies, 0.99), 1)
        r.completions_received = len(done)
        semaphore = asyncio.Semaphore(16)

        async def check(outcome: Outcome) -> tuple[int, bool]:
            async with semaphore:
                response = await self.http.get(f"/v1/trajectories/{outcome.trajectory_id}")
            rows = response.json().get("completions", []) if response.status_code == 200 else []
            tokens_match = len(rows) == 1 and len(rows[0]["output_token_ids"]) == outcome.completion_tokens
            return len(rows), tokens_match

        results = await asyncio.gather(*(check(o) for o in done))
        r.completions_recorded = sum(min(rows, 1) for rows, _ in results)
        r.lost_completions = sum(1 for rows, _ in results if rows == 0)
        r.token_count_mismatches = sum(1 for rows, ok in results if rows and not ok)
        details = await self.health()
        r.engine_restarts = int(details.get("engine", {}).get("restarts", 0))
        r.healthy_at_end = (await self.http.get("/health")).status_code == 200
        await self.http.aclose()


def print_table(report: Report) -> None:
    rows = [
        ("requests sent / succeeded", f"{report.requests_sent} / {report.succeeded}"),
        ("failed outside the engine-kill window (target 0)", report.failed_outside_engine_kill),
        ("failed inside it (503 without Retry-After)",
         f"{report.failed_inside_engine_kill} ({report.inside_kill_without_retry_after})"),
        ("failed by status", report.failed_by_status),
        ("completions received / recorded / lost (target 0)",
         f"{report.completions_received} / {report.completions_recorded} / {report.lost_completions}"),
        ("token count mismatches (target 0)", report.token_count_mismatches),
        ("stream latency p50 / p99 ms", f"{report.p50_ms} / {report.p99_ms}"),
        ("steps committed", report.steps_committed),
        ("train jobs", report.train_jobs),
        ("engine restarts / down s", f"{report.engine_restarts} / {report.engine_down_seconds}"),
        ("trainer killed mid-job", report.trainer_killed_mid_job),
        ("bad inputs sent / not a shaped 4xx (target 0)",
         f"{sum(report.bad_inputs.values())} / {len(report.bad_input_failures)}"),
        ("1-token p99 idle / while preparing 64 trajectories ms",
         f"{report.idle_probe_p99_ms} / {report.preparing_probe_p99_ms} ({report.preparing_probes} probes)"),
        ("GET /v1/models p99 idle / while preparing ms (the proxy's event loop)",
         f"{report.idle_loop_p99_ms} / {report.preparing_loop_p99_ms} ({report.preparing_loop_probes} probes)"),
        ("healthy at the end", report.healthy_at_end),
    ]
    width = max(len(name) for name, _ in rows)
    print(f"soak: {report.minutes} min, {report.concurrency} concurrent streams, {report.machine['cpu']}")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    for failure in report.bad_input_failures[:10]:
        print(f"  bad input not handled: {failure}")
    for line in report.server_errors[:10]:
        print(f"  server log: {line}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="1 minute, 16 streams (a smoke run, not the target)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "soak.json")
    parser.add_argument("--server-arg", action="append", default=[], help="extra `artlike serve` argument")
    args = parser.parse_args()
    minutes, concurrency = (1.0, 16) if args.quick else (args.minutes, args.concurrency)
    with tempfile.TemporaryDirectory(prefix="artlike-soak-") as data_dir, \
            ServerProcess(Path(data_dir), args=args.server_arg, api_key=API_KEY) as server:
        registered = httpx.post(f"{server.base_url}/v1/trainable_models", headers=server.headers, timeout=300,
                                json={"name": MODEL, "base_model": server.model_id, "lora": {"rank": 8}})
        registered.raise_for_status()
        report = asyncio.run(Soak(server, minutes=minutes, concurrency=concurrency,
                                  max_tokens=args.max_tokens).run())
        lines = server.log_path.read_text(errors="replace").splitlines()
        report.server_errors = [line[:300] for line in lines if " ERROR " in line or " CRITICAL " in line][:50]
    print_table(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(asdict(report), indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
