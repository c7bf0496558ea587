"""The same training steps through the Tinker SDK and through artlike's own training sessions, and several
Tinker runs at once, on one server in one run.

    python -m bench.tinker_api [--steps N] [--datums D]

Overhead: a `forward_backward` + `optim_step` of the same D sequences, alternating paths step by step (the
native `/v1/training_sessions` route with its `cross_entropy` / `importance_sampling` loss, and the SDK with
Tinker's loss of that name), median seconds per step of each and their ratio. Concurrency: N = 1, 2, 4 SDK
runs, each taking `steps` steps at once; aggregate trained tokens per second. Prints a table, writes JSON.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--datums", type=int, default=8)
    parser.add_argument("--out", default="bench/results/tinker_api.json")
    args = parser.parse_args()
    with ServerProcess(Path(tempfile.mkdtemp(prefix="bench-tinker-")), api_key=KEY) as server:
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
        concurrency: dict[str, Any] = {}
        for n in (1, 2, 4):
            runs = [service.create_lora_training_client(base_model=server.model_id, rank=8).result() for _ in range(n)]
            for run in runs:
                tinker_step(run, batch, "cross_entropy")  # warm-up
            began = time.perf_counter()
            with ThreadPoolExecutor(max_workers=n) as pool:
                list(pool.map(lambda run: [tinker_step(run, batch, "cross_entropy") for _ in range(args.steps)], runs))
            wall = time.perf_counter() - began
            concurrency[str(n)] = {"seconds": wall, "tokens_per_s": n * args.steps * tokens / wall}
    single = concurrency["1"]["tokens_per_s"]
    result = {"machine": machine(), "steps": args.steps, "datums": args.datums, "tokens_per_step": tokens,
              "overhead": overhead, "concurrency": concurrency,
              "aggregate_ratios": {n: c["tokens_per_s"] / single for n, c in concurrency.items()}}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"{'loss':<22}{'native s/step':>15}{'tinker s/step':>15}{'ratio':>8}")
    for loss, row in overhead.items():
        print(f"{loss:<22}{row['native_seconds']:>15.2f}{row['tinker_seconds']:>15.2f}{row['ratio']:>8.3f}")
    print(f"{'runs':<6}{'tokens/s':>10}{'vs one run':>12}")
    for n, row in concurrency.items():
        print(f"{n:<6}{row['tokens_per_s']:>10.1f}{row['tokens_per_s'] / single:>12.2f}")


if __name__ == "__main__":
    main()
