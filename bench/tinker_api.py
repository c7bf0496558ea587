"""The same training steps through the Tinker SDK and through artlike's own training sessions, and several
Tinker runs at once, on one server in one run.

    python -m bench.tinker_api [--steps N] [--datums D] [--rounds R]

Overhead: a `forward_backward` + `optim_step` of the same D sequences, alternating paths step by step (the
native `/v1/training_sessions` route with its `cross_entropy` / `importance_sampling` loss, and the SDK with
Tinker's loss of that name), median seconds per step of each and their ratio. Concurrency: the first 1, 2 and
4 of the same four SDK runs, each taking `steps` steps at once, in interleaved rounds; the median aggregate
trained tokens per second, on a server that fuses the passes of runs that wait at once (the default) and on
one started with `--no-fuse-passes` (both up, their rounds interleaved), with the share of passes that ran
fused; against one run, the median over rounds of each round's ratio to its own single run. Batching: one
run's step on 4×D sequences against its step on D, what one wider pass gains with a single adapter. Prints a
table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import tinker
from artlike_server.launcher import ServerProcess
from tinker import types

from bench.machine import machine

KEY = "bench-key"
RUNS = (1, 2, 4)
LOSSES = ("cross_entropy", "importance_sampling")


def sequences(server: ServerProcess, count: int) -> list[list[int]]:
    texts = [f"Question {i}: what is {i} plus {i}? Answer: it is {2 * i}, of course." for i in range(count)]
    return [httpx.post(f"{server.base_url}/tokenize", headers=server.headers, json={"prompt": text},
                       timeout=60).json()["tokens"] for text in texts]


def tinker_data(batch: list[list[int]], loss: str) -> list[types.Datum]:
    def inputs(tokens: list[int]) -> dict[str, Any]:
        n = len(tokens) - 1
        if loss == "cross_entropy":
            return {"target_tokens": tokens[1:], "weights": [1.0] * n}
        return {"target_tokens": tokens[1:], "logprobs": [-1.0] * n, "advantages": [0.5] * n}
    return [types.Datum(model_input=types.ModelInput.from_ints(t[:-1]), loss_fn_inputs=inputs(t)) for t in batch]


def native_body(batch: list[list[int]], loss: str) -> dict[str, Any]:
    if loss == "cross_entropy":
        return {"loss": loss, "sequences": [{"token_ids": t} for t in batch]}
    return {"loss": loss, "sequences": [{"token_ids": t, "logprobs": [None] + [-1.0] * (len(t) - 1),
                                         "advantage": 0.5} for t in batch]}


class Native:
    def __init__(self, server: ServerProcess, name: str) -> None:
        self.http = httpx.Client(base_url=server.base_url, headers=server.headers, timeout=600)
        self.http.post("/v1/trainable_models", json={"name": name, "base_model": server.model_id,
                                                     "lora": {"rank": 8, "alpha": 16}}).raise_for_status()
        opened = self.http.post("/v1/training_sessions", json={"model": name, "optimizer": {"learning_rate": 1e-4}})
        opened.raise_for_status()
        self.session = opened.json()["id"]

    def step(self, batch: list[list[int]], loss: str) -> float:
        began = time.perf_counter()
        self.http.post(f"/v1/training_sessions/{self.session}/forward_backward",
                       json=native_body(batch, loss)).raise_for_status()
        self.http.post(f"/v1/training_sessions/{self.session}/optim_step", json={}).raise_for_status()
        return time.perf_counter() - began


def tinker_step(run: tinker.TrainingClient, batch: list[list[int]], loss: str) -> float:
    began = time.perf_counter()
    run.forward_backward(tinker_data(batch, loss), loss)
    run.optim_step(types.AdamParams(learning_rate=1e-4)).result()
    return time.perf_counter() - began


def batching_bound(service: tinker.ServiceClient, server: ServerProcess, small: list[list[int]], datums: int,
                   steps: int) -> dict[str, Any]:
    """What batching several runs' sequences into one trainer pass could gain at most: one run's step on
    `datums` sequences against its step on the `small` batch, trained tokens per second of each (median of
    `steps`, alternating). A pass over several runs' adapters at once costs at least the larger pass."""
    large = sequences(server, datums)
    run = service.create_lora_training_client(base_model=server.model_id, rank=8).result()
    tinker_step(run, small, "cross_entropy"), tinker_step(run, large, "cross_entropy")  # warm-up
    rates: dict[str, list[float]] = {"small": [], "large": []}
    for _ in range(steps):
        for key, batch in (("small", small), ("large", large)):
            rates[key].append(sum(len(t) - 1 for t in batch) / tinker_step(run, batch, "cross_entropy"))
    small_rate, large_rate = (statistics.median(rates[key]) for key in ("small", "large"))
    return {"small_datums": len(small), "large_datums": datums, "small_tokens_per_s": small_rate,
            "large_tokens_per_s": large_rate, "ratio": large_rate / small_rate}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--datums", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds of 1, 2, 4 runs at once; median")
    parser.add_argument("--out", default="bench/results/tinker_api.json")
    args = parser.parse_args()
    with (ServerProcess(Path(tempfile.mkdtemp(prefix="bench-tinker-")), api_key=KEY) as server,
          ServerProcess(Path(tempfile.mkdtemp(prefix="bench-tinker-")), api_key=KEY,
                        args=["--no-fuse-passes"]) as unfused):  # fmt: skip
        batch = sequences(server, args.datums)
        tokens = sum(len(t) - 1 for t in batch)
        service = tinker.ServiceClient(base_url=server.base_url, api_key=f"tml-{KEY}")
        overhead: dict[str, Any] = {}
        for loss in LOSSES:
            native = Native(server, f"bench-native-{loss.replace('_', '-')}")
            run = service.create_lora_training_client(base_model=server.model_id, rank=8).result()
            native.step(batch, loss), tinker_step(run, batch, loss)  # warm-up: first passes load the adapters
            times: dict[str, list[float]] = {"native": [], "tinker": []}
            for _ in range(args.steps):
                times["native"].append(native.step(batch, loss))
                times["tinker"].append(tinker_step(run, batch, loss))
            medians = {path: statistics.median(values) for path, values in times.items()}
            overhead[loss] = {**{f"{path}_seconds": value for path, value in medians.items()},
                              "ratio": medians["tinker"] / medians["native"]}
        # Both servers are up (the idle one computes nothing); their rounds interleave, so that a drift of
        # the machine's speed meets every mode and N alike.
        targets = {"fused": (server, service),
                   "separate": (unfused, tinker.ServiceClient(base_url=unfused.base_url, api_key=f"tml-{KEY}"))}
        # The same runs throughout: every measurement has the same adapters loaded on the trainer (a pass's
        # bookkeeping grows with them), and a round runs its N in the other order from the last.
        runs = {mode: warm_runs(client, target, batch, max(RUNS)) for mode, (target, client) in targets.items()}
        rates: dict[str, dict[str, list[float]]] = {mode: {str(n): [] for n in RUNS} for mode in targets}
        shares: dict[str, dict[str, list[float]]] = {mode: {str(n): [] for n in RUNS} for mode in targets}
        for round_ in range(args.rounds):
            for mode, (target, _) in targets.items():
                for n in RUNS if round_ % 2 == 0 else reversed(RUNS):
                    rate, share = runs_at_once(target, runs[mode][:n], batch, args.steps)
                    rates[mode][str(n)].append(rate)
                    shares[mode][str(n)].append(share)
        concurrency = {mode: {n: {"tokens_per_s": statistics.median(values), **vs_one_run(values, per_n["1"]),
                                  "rounds": values, "fused_share": statistics.median(shares[mode][n])}
                              for n, values in per_n.items()} for mode, per_n in rates.items()}  # fmt: skip
        batching = batching_bound(service, server, batch, args.datums * max(RUNS), args.steps)
    result = {"machine": machine(), "steps": args.steps, "datums": args.datums, "tokens_per_step": tokens,
              "rounds": args.rounds, "overhead": overhead, "concurrency": concurrency, "batching": batching}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"{'loss':<22}{'native s/step':>15}{'tinker s/step':>15}{'ratio':>8}")
    for loss, row in overhead.items():
        print(f"{loss:<22}{row['native_seconds']:>15.2f}{row['tinker_seconds']:>15.2f}{row['ratio']:>8.3f}")
    print(f"{'passes':<10}{'runs':<6}{'tokens/s':>10}{'vs one run':>12}{'fused':>8}")
    for mode, rows in concurrency.items():
        for n, row in rows.items():
            print(f"{mode:<10}{n:<6}{row['tokens_per_s']:>10.1f}{row['vs_one_run']:>12.2f}{row['fused_share']:>8.2f}")
    print(f"one pass of {batching['large_datums']} sequences: {batching['ratio']:.2f}x the tokens/s of "
          f"{batching['small_datums']}")


def vs_one_run(rates: list[float], one_run: list[float]) -> dict[str, Any]:
    """Each round's aggregate rate over the single run's of the same round (they ran minutes apart, so the
    machine's drift between rounds cancels out): the median ratio and the rounds' lowest and highest."""
    ratios = [rate / one for rate, one in zip(rates, one_run, strict=True)]
    return {"vs_one_run": statistics.median(ratios), "vs_one_run_range": [min(ratios), max(ratios)],
            "ratio_rounds": ratios}


def trainer_passes(server: ServerProcess) -> tuple[float, float]:
    """The trainer's session passes so far, and how many of them ran fused with other runs' passes."""
    text = httpx.get(f"{server.base_url}/metrics", headers=server.headers, timeout=60).text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("artlike_trainer_")}
    return values["artlike_trainer_session_passes"], values["artlike_trainer_fused_passes"]


def warm_runs(service: tinker.ServiceClient, server: ServerProcess, batch: list[list[int]],
              n: int) -> list[tinker.TrainingClient]:
    """`n` new runs, each past its first step (which loads its adapter on the trainer)."""
    runs = [service.create_lora_training_client(base_model=server.model_id, rank=8).result() for _ in range(n)]
    for run in runs:
        tinker_step(run, batch, "cross_entropy")
    return runs


def runs_at_once(server: ServerProcess, runs: list[tinker.TrainingClient], batch: list[list[int]],
                 steps: int) -> tuple[float, float]:
    """`runs` taking `steps` steps each at once: the aggregate trained tokens/s, and the share of their
    passes that ran fused."""
    tokens = sum(len(t) - 1 for t in batch)
    passes_before, fused_before = trainer_passes(server)
    began = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(runs)) as pool:
        list(pool.map(lambda run: [tinker_step(run, batch, "cross_entropy") for _ in range(steps)], runs))
    rate = len(runs) * steps * tokens / (time.perf_counter() - began)
    passes_after, fused_after = trainer_passes(server)
    return rate, (fused_after - fused_before) / max(1.0, passes_after - passes_before)


if __name__ == "__main__":
    main()
