"""Rollout speed of the trained policy through artlike with and without a policy engine, in one run.

    python -m bench.policy_engine [--quick] [--dtype auto|bfloat16|float32]

`artlike serve --policy-engines 1` starts, beside the LoRA engine(s), an engine without LoRA whose weights
are the base model with the current step's adapter merged in (engine/policy.py): requests for the trained
model's current step go to it. `bench/lora_serving.py` measures the ceiling straight to vLLM (a plain engine
runs the base model faster than a LoRA engine runs a rank-8 adapter); this bench measures what a
training loop actually gets through the proxy on this machine, where the policy engine has to take cores
from the LoRA engine (`--engine-cpus` is split between all engines). Three rows, the same load each
(C concurrent chat completions of T tokens for the trained model, `ignore_eos`, temperature 1.0):

    proxy/lora            `--engines 1`: one LoRA engine on all cores; `bench` (step 1) is served as an adapter
    proxy/policy-engine   `--engines 1 --policy-engines 1`: cores split between the two; `bench` (step 1) is
                          served by the policy engine from merged weights (checked: its request count rises
                          by exactly the requests sent)
    direct/plain-engine   a vLLM engine without LoRA on all cores, base-model requests straight to vLLM: the
                          best one policy can do here (merged weights compute what base weights compute)

Each server gets a fresh data dir, registers `bench` (LoRA rank 8, the default) and trains one step from two
small groups of its own rollouts; the servers run one after another, never two at once. Also recorded: the
policy engine's merge+verify time for the step (`last_sync_s`) and its verification logprob difference
(`probe_diff`). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import orjson
from artlike_server.default_model import DEFAULT_MODEL_ID, ensure_default_model
from artlike_server.engine.launch import EngineConfig, free_port
from artlike_server.launcher import ServerProcess

from bench.lora_serving import KEY, load, run_engine
from bench.machine import machine

NAME = "bench"
ENGINE_KEY = "policy-bench-engine-key"
TRAIN_PROMPTS = ["Name a fruit.", "Say something about the sea."]


def health_engines(server: ServerProcess) -> dict[str, dict[str, Any]]:
    response = httpx.get(f"{server.base_url}/health", headers=server.headers, timeout=30)  # details need the key
    return {engine["id"]: engine for engine in response.json()["engines"]}


def wait_for(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.5)  # polling another process's /health: nothing to await instead
    raise RuntimeError(f"not within {timeout:.0f}s: {what}")


def sample(server: ServerProcess, prompt: str) -> dict[str, Any]:
    """One recorded rollout through a trajectory URL."""
    trajectory_id = uuid.uuid4().hex
    response = httpx.post(f"{server.base_url}/t/{trajectory_id}/v1/chat/completions", headers=server.headers,
                          timeout=300, json={"model": NAME, "messages": [{"role": "user", "content": prompt}],
                                             "max_tokens": 8, "temperature": 1.0})
    response.raise_for_status()
    return {"trajectory_id": trajectory_id}


def train_one_step(server: ServerProcess) -> dict[str, Any]:
    """Register `bench` (rank 8) and train step 1 from 2 groups of 2 rollouts, rewards by position (so every
    group has signal whatever the samples' lengths). Returns the final `done` line."""
    response = httpx.post(f"{server.base_url}/v1/trainable_models", headers=server.headers, timeout=300,
                          json={"name": NAME, "base_model": server.model_id, "lora": {"rank": 8}})
    if response.status_code not in (200, 201):
        raise RuntimeError(f"register: {response.status_code} {response.text}")
    prompts = [prompt for prompt in TRAIN_PROMPTS for _ in range(2)]
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        trajectories = list(pool.map(lambda prompt: sample(server, prompt), prompts))
    groups = [{"trajectories": [t | {"reward": float(i)} for i, t in enumerate(trajectories[g * 2:g * 2 + 2])]}
              for g in range(len(TRAIN_PROMPTS))]
    body = {"model": NAME, "groups": groups, "config": {"learning_rate": 5e-3}}
    last: dict[str, Any] = {}
    with httpx.Client(timeout=900, headers=server.headers) as http, \
            http.stream("POST", f"{server.base_url}/_train_model", json=body) as stream:
        if stream.status_code != 200:
            raise RuntimeError(f"/_train_model: {stream.status_code} {stream.read()!r}")
        for line in stream.iter_lines():
            if line:
                last = orjson.loads(line)
    if last.get("type") != "done" or last.get("step") != 1:
        raise RuntimeError(f"training did not finish step 1: {last}")
    return last


def proxy_row(dtype: str, args: argparse.Namespace, *, policy: bool) -> dict[str, Any]:
    server_args = ["--dtype", dtype, "--engines", "1", "--engine-api-key", ENGINE_KEY]
    if policy:
        server_args += ["--policy-engines", "1"]
    data_dir = Path(tempfile.mkdtemp(prefix=f"policy-engine-bench-{'policy' if policy else 'lora'}-"))
    with ServerProcess(data_dir, args=server_args, api_key=KEY) as server:
        wait_for(lambda: all(e["serving"] for e in health_engines(server).values()), 900, "every engine serving")
        started = time.perf_counter()
        done = train_one_step(server)
        row: dict[str, Any] = {"train_seconds": time.perf_counter() - started, "data_dir": str(data_dir)}
        if policy:
            started = time.perf_counter()
            wait_for(lambda: health_engines(server)["policy-0"]["holds"] == done["model"], 600,
                     f"the policy engine holds {done['model']}")
            row["wait_for_merge_seconds"] = time.perf_counter() - started
            before = health_engines(server)["policy-0"]
        row |= asyncio.run(load(server.base_url, NAME, args.concurrency, args.tokens, args.rounds))
        if policy:
            after = health_engines(server)["policy-0"]
            sent = 1 + args.concurrency * args.rounds  # the warm-up request, then the rounds
            row |= {"holds": after["holds"], "last_sync_s": after["last_sync_s"], "probe_diff": after["probe_diff"],
                    "syncs": after["syncs"], "policy_requests_delta": after["requests"] - before["requests"],
                    "requests_sent": sent}
            if row["policy_requests_delta"] != sent:
                raise RuntimeError(f"policy-0 served {row['policy_requests_delta']} of {sent} requests: {after}")
    return row


def resolve_dtype(dtype: str) -> str:
    if dtype != "auto":
        return dtype
    from artlike_server.dtype_choice import choose_dtypes
    return choose_dtypes({"engine": "auto"}, "cpu")["engine"].dtype


def run(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = ensure_default_model()
    dtype = resolve_dtype(args.dtype)
    rows: dict[str, dict[str, Any]] = {}
    rows["proxy/lora"] = proxy_row(dtype, args, policy=False)
    rows["proxy/policy-engine"] = proxy_row(dtype, args, policy=True)
    work = Path(tempfile.mkdtemp(prefix="policy-engine-bench-plain-"))
    config = EngineConfig(model_path=model_dir, served_model_name=DEFAULT_MODEL_ID, port=free_port(),
                          log_path=work / "engine-plain.log", dtype=dtype)
    rows |= asyncio.run(run_engine(config, lora=False, jobs=[("direct/plain-engine", DEFAULT_MODEL_ID)],
                                   adapter=None, concurrency=args.concurrency, tokens=args.tokens,
                                   rounds=args.rounds))
    rate = {row: values["tokens_per_s"] for row, values in rows.items()}
    return {
        "machine": machine(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "dtype": dtype, "concurrency": args.concurrency, "tokens": args.tokens, "rounds": args.rounds,
        "rows": rows,
        "policy_engine_over_proxy_lora": rate["proxy/policy-engine"] / rate["proxy/lora"],
        "policy_engine_over_direct_plain": rate["proxy/policy-engine"] / rate["direct/plain-engine"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 round of 16 x 32 tokens")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "policy_engine.json")
    args = parser.parse_args()
    if args.quick:
        args.concurrency, args.tokens, args.rounds = 16, 32, 1
    result = run(args)
    print(f"{'row':<22} {'tokens/s':>10}   ({result['concurrency']} concurrent x {result['tokens']} tokens, "
          f"{result['dtype']}, median of {result['rounds']} rounds; {result['machine']['cpu']}, "
          f"{result['machine']['cores']} cores)")
    for row, values in result["rows"].items():
        print(f"{row:<22} {values['tokens_per_s']:>10.1f}")
    policy = result["rows"]["proxy/policy-engine"]
    print(f"policy engine / proxy LoRA: {result['policy_engine_over_proxy_lora']:.2f}x; "
          f"policy engine (proxy, half the cores) / direct plain engine: "
          f"{result['policy_engine_over_direct_plain']:.2f}x")
    print(f"policy engine: holds {policy['holds']}, merge+verify {policy['last_sync_s']:.2f} s, "
          f"probe_diff {policy['probe_diff']:.2g}, served {policy['policy_requests_delta']} of "
          f"{policy['requests_sent']} requests")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
