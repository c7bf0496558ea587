"""bench/README.md's result tables, generated from the result files: `python -m bench.tables` rewrites them.

Each table sits between `<!-- bench:NAME -->` and `<!-- /bench -->` and names its result file and the
machine it was measured on; tests/docs/test_bench_tables.py fails when the README differs from this output.
"""

from __future__ import annotations

import functools
import json
import math
import re
import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from bench.machine import describe, same_kind
from examples.arithmetic.task import HELD_OUT_SEED, TRAINING_SEED, problems

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
README = BENCH / "README.md"
RESULTS = BENCH / "results"
EMAIL_AGENT = ROOT / "examples" / "email_agent"
BLOCK = re.compile(r"(<!-- bench:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /bench -->)", re.DOTALL)

Result = dict[str, Any]


def table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def caption(result_file: str, result: Result, what: str = "") -> str:
    speed = f" (matmul {result['speed']:g} GFLOP/s in bfloat16)" if result.get("speed") else ""
    return f"`bench/results/{result_file}`{what}, measured on {describe(result['machine'])}{speed}:"


def percent(value: float) -> str:
    return f"{value:.1%}"


def email_agent(results: Sequence[Result]) -> str:
    """The example's before/after table, one pair of columns per corpus seed."""
    header = ["metric (subject test questions, greedy)"]
    columns: list[list[str]] = []
    for result in results:
        seed = result["config"]["seed"]
        header += [f"seed {seed} before", f"**seed {seed} after**"]
        before, after = result["evaluations"].values()
        difference = result["accuracy_difference"]
        gain = (f"{percent(after['answer_accuracy'])} ({difference['difference'] * 100:+.1f}, 95% CI "
                f"{difference['low'] * 100:+.1f} … {difference['high'] * 100:+.1f})")
        for summary, accuracy, steps in ((before, percent(before["answer_accuracy"]), ""),
                                         (after, f"**{gain}**", f"{result['last_step'] - result['first_step']}, "
                                                                f"{result['wall_seconds'] / 60:.1f} min")):
            given = summary["answer_accuracy"] / summary["answer_rate"] if summary["answer_rate"] else 0.0
            columns.append([str(summary["questions"]), accuracy, percent(given), percent(summary["answer_rate"]),
                            percent(summary["invalid_tool_call_rate"]), f"{summary['mean_turns']:.2f}",
                            percent(summary["source_accuracy"]), f"{summary['mean_reward']:+.3f}", steps])
    labels = ["test questions", "answer accuracy", "accuracy of the answers given", "answer rate",
              "invalid tool-call rate", "mean turns", "source accuracy", "mean reward (default weights)",
              "GRPO steps, wall time"]
    files = ", ".join(f"[`{path.name}`]({path.name})" for path in EMAIL_AGENT_RESULTS)
    machines = {describe(result["machine"]) for result in results}
    return "\n\n".join([f"{files}, measured on {', '.join(sorted(machines))}:",
                         table(header, [[label, *(column[row] for column in columns)]
                                        for row, label in enumerate(labels)])])


def lora_serving(result: Result) -> str:
    rate = {row: values["tokens_per_s"] for row, values in result["rows"].items()}
    adapter = rate["lora-engine/adapter"]
    rows = [("LoRA engine, adapter (`name@N`)", "lora-engine/adapter"), ("LoRA engine, base model", "lora-engine/base"),
            ("engine without LoRA (= merged weights)", "plain-engine/base")]
    return "\n\n".join([
        caption("lora_serving.json", result, f", {result['dtype']}"),
        table(["row", "tokens/s", "vs adapter"], [(label, f"{rate[key]:.0f}", f"{rate[key] / adapter:.2f}×")
                                                 for label, key in rows]),
        f"A PEFT merge + save of the policy took {result['merge_and_save_seconds']:.1f} s a step."])


def engine_start(result: Result) -> str:
    rows = [("worker process (vLLM's CPU default)", "worker-process"),
            ("model in a spawned engine-core process (vLLM-CPU's start)", "in-engine-core"),
            ("model in a forked engine-core process (artlike)", "forked-core")]
    values = result["rows"]
    return "\n\n".join([
        caption("engine_start.json", result, f", {result['dtype']}"),
        table(["row", "start (s)", "tokens/s"], [(label, f"{values[key]['start_seconds']:.1f}",
                                                  f"{values[key]['tokens_per_s']:.0f}") for label, key in rows]),
        f"In the engine core instead of a worker process: start {result['start_ratio']:.2f}× the time, throughput "
        f"{result['throughput_ratio']:.2f}×. Forked instead of spawned: start {result['fork_start_ratio']:.2f}× "
        f"the time, throughput {result['fork_throughput_ratio']:.2f}×. The greedy text of the same prompts is "
        f"{'identical in every row' if result['same_greedy_text'] else 'different'}."])


def tinker_api(result: Result) -> str:
    overhead = table(["loss", "native s/step", "Tinker SDK s/step", "ratio"],
                     [(f"`{loss}`", f"{row['native_seconds']:.2f}", f"{row['tinker_seconds']:.2f}",
                       f"{row['ratio']:.3f}") for loss, row in result["overhead"].items()])
    fused, separate = result["concurrency"]["fused"], result["concurrency"]["separate"]

    def versus(row: Result) -> str:
        low, high = row["vs_one_run_range"]
        return f"{row['vs_one_run']:.2f}" + (f" ({low:.2f}–{high:.2f})" if low != high else "")

    runs = table(["runs at once", "fused: tokens/s", "vs one run", "passes fused", "one by one: tokens/s",
                  "vs one run"],
                 [(n, f"{row['tokens_per_s']:.1f}", versus(row), f"{row['fused_share']:.0%}",
                   f"{separate[n]['tokens_per_s']:.1f}", versus(separate[n]))
                  for n, row in fused.items()])
    batching = result["batching"]
    return "\n\n".join([
        caption("tinker_api.json", result, f", {result['datums']} sequences ({result['tokens_per_step']} trained "
                f"tokens) per step, median of {result['steps']} steps; runs at once: the same four runs, median of "
                f"{result['rounds']} interleaved rounds, vs one run: each round against its own single run "
                f"(lowest–highest round)"), overhead, runs,
        f"One run's step on {batching['large_datums']} sequences trains {batching['large_tokens_per_s']:.1f} "
        f"tokens/s, {batching['ratio']:.2f}× its step on {batching['small_datums']} "
        f"({batching['small_tokens_per_s']:.1f} tokens/s)."])


def policy_engine(result: Result) -> str:
    rows = result["rows"]
    lora, policy, plain = (rows[key]["tokens_per_s"] for key in ("proxy/lora", "proxy/policy-engine",
                                                                "direct/plain-engine"))
    merged = rows["proxy/policy-engine"]
    return "\n\n".join([
        caption("policy_engine.json", result, f", {result['dtype']}"),
        table(["row", "tokens/s", "ratio"], [
            ("proxy, LoRA adapter (2 cores)", f"{lora:.0f}", "1.00×"),
            ("proxy, policy engine (1 core)", f"{policy:.0f}", f"{policy / lora:.2f}× LoRA"),
            ("direct vLLM, no LoRA (2 cores)", f"{plain:.0f}", f"policy engine = {policy / plain:.2f}× of it")]),
        table(["policy engine", "measured"], [
            ("merge + verify per step (the merge inside vLLM and the probe against the LoRA engine)",
             f"{merged['last_sync_s']:.2f} s"),
            ("`probe_diff` of that probe", f"{merged['probe_diff']:.3f}"),
            ("the new step served, after the training call returned", f"{merged['wait_for_merge_seconds']:.1f} s"),
            ("requests it served / sent to it", f"{merged['policy_requests_delta']} / {merged['requests_sent']}")])])


def soak(result: Result) -> str:
    statuses = result["failed_by_status"]
    jobs = result["train_jobs"]
    bad = sum(result["bad_inputs"].values())
    failed_jobs = ", ".join(f"{count} `{name.removeprefix('error_')}`" for name, count in sorted(jobs.items())
                            if name != "done")
    retry = "all with `Retry-After`" if result["inside_kill_without_retry_after"] == 0 else (
        f"{result['inside_kill_without_retry_after']} without `Retry-After`")
    return "\n\n".join([
        caption("soak.json", result, f", {result['minutes']:g} min, {result['concurrency']} concurrent recorded streams"),
        table(["what", "measured", "target"], [
            ("streaming requests sent / completed with `[DONE]`", f"{result['requests_sent']:,} / {result['succeeded']:,}", ""),
            ("failed outside the engine-kill window", f"**{result['failed_outside_engine_kill']}**", "0"),
            (f"failed inside it ({result['engine_down_seconds']:.1f} s down)",
             f"{result['failed_inside_engine_kill']:,}: {statuses.get('503', 0):,} × 503 {retry}, "
             f"{statuses.get('200', 0)} streams cut by the kill", "503 + Retry-After"),
            ("completions received / recorded / lost; token-count mismatches",
             f"{result['completions_received']:,} / {result['completions_recorded']:,} / "
             f"**{result['lost_completions']}**; **{result['token_count_mismatches']}**", "0 lost"),
            ("stream latency p50 / p99 (while training)",
             f"{result['p50_ms'] / 1000:.1f} s / {result['p99_ms'] / 1000:.1f} s", ""),
            ("training steps committed (each a hot swap)", f"{result['steps_committed']} (failed jobs: {failed_jobs}; "
             "the previous step stayed served)", "several"),
            (f"bad inputs ({len(result['bad_inputs'])} kinds) answered a 4xx in the OpenAI shape",
             f"{bad - len(result['bad_input_failures'])} / {bad}", "all"),
            ("1-token chat completion p99, idle / while 64-trajectory requests are prepared",
             f"{result['idle_probe_p99_ms']:.0f} ms / {result['preparing_probe_p99_ms']:.0f} ms "
             f"(**{result['preparing_probe_p99_ms'] / result['idle_probe_p99_ms']:.2f}×**, "
             f"{result['preparing_probes']} probes)", "≤ 2×"),
            ("`GET /v1/models` p99 (the proxy's event loop alone), idle / while preparing",
             f"{result['idle_loop_p99_ms']:.1f} ms / {result['preparing_loop_p99_ms']:.1f} ms "
             f"({result['preparing_loop_probes']} probes)", ""),
            ("healthy at the end", "yes" if result["healthy_at_end"] else "**no**", "yes")])])


def feedback_loop(result: Result) -> str:
    rows = result["rows"]
    best = max(rows, key=lambda row: row["mean_rating"])
    shown = [row for row in rows if row["ratings"] % 48 == 0 or row is best or row is rows[-1]]
    skipped = sum(1 for row in rows if row.get("run", "").startswith("no step"))
    return "\n\n".join([
        caption("feedback_loop.json", result, f", {rows[-1]['seconds'] / 60:.0f} min for {rows[-1]['ratings']} ratings"),
        table(["ratings", *(str(row["ratings"]) for row in shown)], [
            ["step served", *(str(row["step"]) for row in shown)],
            ["mean rating of fresh held-out samples (1–5)", *(f"{row['mean_rating']:.2f}" for row in shown)],
            ["mean words", *(f"{row['mean_words']:.1f}" for row in shown)]]),
        f"{skipped} of {len(rows) - 1} rounds made no step (their ratings were all equal; the next round's "
        "ratings trained together with them)."])


def proxy_overhead(result: Result) -> str:
    summary = result["summary"]

    def ratio(target: str, baseline: str, concurrency: int, stream: bool, interval: bool = False) -> str:
        row = next(s for s in summary if s["scenario"] == "throughput" and s["target"] == target
                   and s["baseline"] == baseline and s["concurrency"] == concurrency and s["stream"] == stream)
        low, high = row["throughput_ratio_ci95"]
        return f"{row['throughput_ratio']:.3f}" + (f" ({low:.2f}–{high:.2f})" if interval else "")

    def added(target: str, baseline: str, interval: bool = False) -> str:
        row = next(s for s in summary if s["scenario"].startswith("latency") and s["target"] == target
                   and s["baseline"] == baseline)
        text = f"+{row['added_p50_ms']:.2f} ms"
        return text + (f" ({row['added_p50_ms_ci95'][0]:.2f}–{row['added_p50_ms_ci95'][1]:.2f})" if interval else "")

    rows = []
    for concurrency in result["config"]["concurrency"]:
        label = "1 request" if concurrency == 1 else f"{concurrency} concurrent"
        rows.append((f"{label}, non-streaming / streaming",
                     " / ".join(ratio("proxy", "direct", concurrency, stream, True) for stream in (False, True)),
                     " / ".join(ratio("proxy+record", "direct+fields", concurrency, stream) for stream in (False, True)),
                     " / ".join(ratio("direct+fields", "direct", concurrency, stream) for stream in (False, True))))
    rows.append(("sequential 1-token requests: added p50", added("proxy", "direct", True),
                 added("proxy+record", "direct+fields"), added("direct+fields", "direct")))
    config = result["config"]
    return "\n\n".join([
        caption("proxy_overhead.json", result, f", {config['max_tokens']} tokens per request, {config['rounds']} rounds"),
        table(["load", "proxy / direct (95% CI)", "proxy+record / direct+fields (the proxy's recording cost)",
               "direct+fields / direct (the engine's)"], rows)])


def number(value: float) -> str:
    """Three significant figures or so, as a table cell reads best: 2,697 / 28.3 / 0.35."""
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"


SCALE_TARGETS = {"direct": "direct (1 fake)", "proxy-1": "proxy, 1 fake", "proxy-2": "proxy, 2 fakes"}


def scale_ceiling(result: Result) -> str:
    cells = result["ceiling"]["cells"]
    clients = result["config"]["concurrency"]
    rows = []
    for target, label in SCALE_TARGETS.items():
        for route in dict.fromkeys(cell["route"] for cell in cells if cell["target"] == target):
            row = {cell["concurrency"]: cell for cell in cells if cell["target"] == target and cell["route"] == route}
            cpu = [row[n]["proxy_cpu_ms_per_request"] for n in clients]
            rows.append([label, route,
                         *(f"{number(row[n]['requests_per_s'])} / {number(row[n]['p50_ms'])} / {number(row[n]['p99_ms'])}"
                           for n in clients),
                         "–" if None in cpu else " / ".join(f"{value:.2f}" for value in cpu),
                         " / ".join(f"{row[n]['server_core_busy']:.0%}" for n in clients)])
    two = [cell for cell in cells if cell["target"] == "proxy-2"]
    served: dict[str, int] = {}
    for cell in two:
        for engine, count in cell["served_by"].items():
            served[engine] = served.get(engine, 0) + count
    trajectories = sum(cell["trajectories"] for cell in two)
    split = " / ".join(f"{count:,}" for _, count in sorted(served.items()))
    return "\n\n".join([
        caption("scale.json", result, ". Per cell: requests/s / p50 ms / p99 ms; then the proxy's CPU ms per "
                "request and how full the server's core was, at " + " / ".join(map(str, clients)) + " clients"),
        table(["target", "route", *(f"{n} client{'s' if n > 1 else ''}" for n in clients), "proxy CPU ms/request",
               "server core busy"], rows),
        f"The 2-fake rows' requests per fake engine: {split}; recorded trajectories served by two engines: "
        f"{sum(cell['trajectories_on_two_engines'] for cell in two)} of {trajectories:,}."])


def scale_engines(result: Result) -> str:
    real = result["real_engines"]
    runs = real["runs"]
    first = runs[0]["cell"]["requests_per_s"]
    rows = []
    for run in runs:
        cell = run["cell"]
        cores = cell["cores_by_process"]
        cpus = run["engine_cpus"]
        where = (f"one core each: {cpus}" if run["engines"] == len(cpus.split(",")) > 1
                 else f"{'core' if ',' not in cpus else 'cores'} {cpus}")
        rows.append([f"{run['engines']} ({where})",
                     f"{cell['requests_per_s']:.1f}" + ("" if run is runs[0] else f" ({cell['requests_per_s'] / first:.2f}×)"),
                     f"{cell['tokens_per_s']:.0f}", f"{cell['p50_ms']:,.0f} / {cell['p99_ms']:,.0f}",
                     " / ".join(str(count) for count in cell["engine_requests"].values()),
                     " / ".join(f"{cores.get(name, 0):.2f}" for name in
                                ("VLLM::Worker", "VLLM::EngineCore", "vllm.entrypoints.openai.api_server")),
                     f"{cores.get('proxy', 0):.2f}"])
    return "\n\n".join([
        caption("scale_engines_pinned.json", result, f", {real['requests']} recorded requests × {real['max_tokens']} "
                f"tokens, {real['concurrency']} concurrent"),
        table(["engines (`--engine-cpus`)", "requests/s", "tokens/s", "p50 / p99 ms", "split",
               "CPU used (cores): workers / EngineCore / API servers", "proxy (cores)"], rows)])


def scale_capacity(result: Result) -> str:
    capacity = result["capacity"]
    plain, recorded = capacity["plain"], capacity["recorded"]
    return "\n\n".join([
        caption("scale.json", result, ", capacity"),
        table(["route", "proxy CPU ms/request (worst at ≥ 64 clients)", "requests/s on one core",
               "one engine's requests/s", "engines per proxy"],
              [(route, f"{values['proxy_cpu_ms_per_request']:.2f}", f"{values['proxy_requests_per_core_s']:,.0f}",
                f"{values['engine_requests_per_s']:.1f}", f"{values['engines_per_proxy']:.0f}")
               for route, values in (("plain", plain), ("recorded", recorded))])])


def proxy_cpu(result: Result) -> str:
    plain, streamed = result["targets"], result["streamed"]
    config = result["config"]
    rows = [("1-token request, direct (what the proxy spends meanwhile: health polls, metrics)", plain["direct"]),
            ("1-token request through the proxy", plain["proxy"]),
            ("1-token request through the proxy, recorded", plain["proxy+record"]),
            (f"{config['stream_tokens']}-token stream, direct", streamed["direct"]),
            (f"{config['stream_tokens']}-token stream through the proxy", streamed["proxy"])]
    return "\n\n".join([
        caption("proxy_cpu.json", result, f", {config['requests']} requests and {config['stream_requests']} streams a target"),
        table(["request", "proxy CPU ms per request", "p50 ms"],
              [(label, f"{values['proxy_cpu_ms_per_request']:.2f}", f"{values['p50_ms']:,.0f}") for label, values in rows]
              + [("a bare Starlette endpoint + httpx caller in one process", f"{result['bare_hop_cpu_ms_per_request']:.2f}", "")]),
        f"A streamed chunk costs the proxy {streamed['proxy']['added_cpu_ms_per_chunk']:.3f} ms of CPU; the median "
        f"stream took {streamed['proxy']['p50_ms'] / streamed['direct']['p50_ms']:.3f}× as long through the proxy."])


def proxy_overhead_dialects(result: Result) -> str:
    rows = [(f"`{s['target']}` over `{s['baseline']}`", f"+{s['added_p50_ms']:.2f} ms",
             f"{s['added_p50_ms_ci95'][0]:.2f}–{s['added_p50_ms_ci95'][1]:.2f}")
            for s in result["summary"] if s["scenario"].startswith("latency")]
    return "\n\n".join([
        caption("proxy_overhead_dialects.json", result,
                f", {result['config']['latency_requests']} sequential 1-token requests a target, paired"),
        table(["target over baseline", "added p50", "95% CI"], rows)])


def train_throughput(result: Result) -> str:
    peaks = ", ".join(f"{dtype} {gflops:.0f} GFLOP/s" for dtype, gflops in result["peak_gflops"].items())
    runs = result["runs"]
    where = "own cores" if result.get("trainer", {}).get("own_cores", True) else "cores shared with an engine"
    rows = [(f"`{run['row']}`", run["dtype"], run["objective"], f"{run['seconds_per_step']:.2f}",
             f"{run['tokens_per_s']:.0f}", f"{run['decoder_positions']:,}", f"{run['gflops']:.0f}",
             f"{run['fraction_of_peak']:.1%}") for run in runs]
    lines = [caption("train_throughput.json", result, f", batches of {result['batch'][0]} × {result['batch'][1]} "
                     f"tokens, the trainer on its {where}; measured matmul peak: {peaks}"),
             table(["row", "dtype", "objective", "s/step", "trained tokens/s", "decoder positions", "GFLOP/s",
                    "of peak"], rows)]
    shared = {run["dtype"]: run for run in runs if run["row"] == "grpo"}
    unshared = {run["dtype"]: run for run in runs if run["row"] == "grpo-unshared"}
    for dtype in shared.keys() & unshared.keys():
        lines.append(f"Sharing the group's prompt ({dtype}): {unshared[dtype]['seconds_per_step'] / shared[dtype]['seconds_per_step']:.2f}× "
                     f"as fast a step ({shared[dtype]['decoder_positions']:,} decoder positions instead of "
                     f"{unshared[dtype]['decoder_positions']:,}).")
    if result.get("bfloat16_skipped"):
        lines.append(f"No bf16 rows: {result['bfloat16_skipped']}.")
    if result.get("swap"):
        lines.append(f"Last step → first streamed token from the new step: {result['swap']['last_step_to_first_token_s']:.3f} s.")
    return "\n\n".join(lines)


def job_learning(result: Result) -> str:
    settings, before, after = result["settings"], result["held_out"]["before"], result["held_out"]["after"]
    rewards = result["reward_per_iteration"]
    first, last = rewards[:3], rewards[-3:]
    return "\n\n".join([
        caption("job_learning.json", result, f", {settings['iterations']} iterations × {settings['batch_size']} rows "
                f"× {settings['group_size']} samples, learning rate {settings['learning_rate']:g}, the job "
                f"{result['status']} in {result['wall_seconds']:.0f} s"),
        table(["held-out pass rate (greedy, correct)", "held-out mean reward",
               f"training reward, iterations 1–3 → {len(rewards) - 2}–{len(rewards)}"],
              [(f"{before['valid_pass_rate']:.3f} → **{after['valid_pass_rate']:.3f}**",
                f"{before['valid_reward_mean']:.3f} → {after['valid_reward_mean']:.3f}",
                f"{sum(first) / len(first):.2f} → {sum(last) / len(last):.2f}")])])


RL_MODES = {"sequential": "sequential", "pipeline": "pipeline (shared cores)",
            "pipeline-split": "pipeline, engine core 0 / trainer core 1",
            "sequential-policy": "sequential, LoRA engine + policy engine (a core each)",
            "pipeline-policy": "pipeline, LoRA engine + policy engine"}


def _median_phase(mode: Result, phase: str) -> float:
    steps = mode["per_step"][1:] or mode["per_step"]
    return statistics.median(step[phase] for step in steps)


def rl_step_core_split(result: Result) -> str:
    """What an overlap could win back on two cores: each half's time on both cores (the sequential loop)
    against its time on one core (the split pipeline), and the best a perfect scheduler could do."""
    modes = {mode["mode"]: mode for mode in result["modes"]}
    if not {"sequential", "pipeline-split"} <= modes.keys():
        return "This result file has no split-core run (`--core-split`)."
    sequential, split = modes["sequential"], modes["pipeline-split"]
    rollouts, training = _median_phase(sequential, "rollout_seconds"), _median_phase(sequential, "train_seconds")
    rollouts_one, training_one = _median_phase(split, "rollout_seconds"), _median_phase(split, "train_seconds")
    best = (rollouts_one + training_one) / 2
    return "\n\n".join([
        caption("rl_step.json", result, ", medians of each mode's steps"),
        table(["", "rollouts", "training", "total"], [
            ("sequential (2 cores each)", f"2 × {rollouts:.2f} s", f"2 × {training:.2f} s",
             f"{2 * (rollouts + training):.1f} core-s"),
            ("one core each (split pipeline)", f"{rollouts_one:.2f} s", f"{training_one:.2f} s",
             f"{rollouts_one + training_one:.1f} core-s")]),
        f"One core does {rollouts_one / rollouts:.2f}× (rollouts) and {training_one / training:.2f}× (training) the "
        f"work of two. A perfect scheduler would need {best:.2f} s a step, "
        f"**{best / sequential['seconds_per_step']:.2f}× of the sequential {sequential['seconds_per_step']:.2f} s**; "
        f"the static split is bound by its slower half ({max(rollouts_one, training_one):.2f} s)."])


def rl_step(result: Result) -> str:
    budget = result["budget_seconds"]
    rows = [(RL_MODES.get(mode["mode"], mode["mode"]), mode["steps"], f"{mode['seconds_per_step']:.1f}",
             f"{mode['engine_idle']:.0%}", f"{mode['trainer_idle']:.0%}", f"{mode['held_out_accuracy']:.0%}")
            for mode in result["modes"]]
    return "\n\n".join([
        caption("rl_step.json", result, f", {budget:.0f} s a mode"),
        table(["mode", f"steps in {budget:.0f} s", "s/step", "engine idle", "trainer idle", "held-out accuracy"], rows),
        f"The pipeline's seconds per step over the sequential loop's: "
        f"{result['pipeline_over_sequential_step_time']:.2f}×."])


def whole_task_accuracy(point: Result, baseline: Result | None) -> str:
    """A checkpoint's greedy accuracy over the whole task, and its difference from its baseline's at the same
    checkpoint: exact for the two models (no sample of problems), so without a margin; the spread between
    runs remains.

    >>> baseline = {"checkpoints": [{"minutes": 30, "greedy_task": 0.8}]}
    >>> whole_task_accuracy({"minutes": 30, "greedy_task": 0.85}, baseline)
    '85.0% (+5.0 points)'
    """
    if "greedy_task" not in point:
        return "—"
    same = [p for p in (baseline or {}).get("checkpoints", [])
            if p["minutes"] == point["minutes"] and "greedy_task" in p]
    if not same or same[0] is point:
        return percent(point["greedy_task"])
    difference = (point["greedy_task"] - same[0]["greedy_task"]) * 100
    return f"{percent(point['greedy_task'])} ({difference:+.1f} points)"


def served_model(settings: Result) -> str:
    """The model a ceiling or plateau run trained, for its caption: nothing for the embedded default."""
    return f", model `{settings['model']}`" if settings.get("model") else ""


def ceiling(result_file: str) -> Callable[[Result], str]:
    """The table of one `bench/ceiling.py` run (its own file): held-out accuracy after each pass over the pool."""
    return functools.partial(ceiling_table, result_file)


def ceiling_table(result_file: str, result: Result) -> str:
    settings, before = result["settings"], result["before"]
    whole_task = "greedy_task" in before  # measured by newer runs only
    rows = [[0, 0, "0", "", percent(before["greedy"]), percent(before["sampled"]),
             unseen_accuracy(before, settings)]]
    rows += [[p["pass"], p["steps"], f"{p['train_seconds']:.0f}", f"{p['loss']:.4f}", percent(p["greedy"]),
              percent(p["sampled"]), unseen_accuracy(p, settings)] for p in result["passes"]]
    if whole_task:
        for row, point in zip(rows, [before, *result["passes"]], strict=True):
            row.append(percent(point["greedy_task"]))
    task_ceiling = (f"; over the whole task, **{percent(result['ceiling_greedy_task'])}**, from "
                    f"{percent(before['greedy_task'])}" if whole_task else "")
    return "\n\n".join([
        caption(result_file, result, f"{served_model(settings)}, {settings['pool_size']} training problems in batches of "
                f"{settings['batch_size']}, lr {settings['learning_rate']:g}, {settings['eval_size']} held-out problems"),
        table(["pass", "steps", "training s", "mean loss", "held-out greedy", "held-out T=1",
               "greedy on unseen problems"] + (["greedy over the whole task"] if whole_task else []), rows),
        f"The ceiling (best held-out greedy accuracy): **{percent(result['ceiling_greedy'])}**, from "
        f"{percent(before['greedy'])} before training{task_ceiling}."])


def difference_margin(first: float, second: float, count: int) -> float:
    """Half the width of a 95% interval of the difference of two accuracies, each over `count` problems
    (normal approximation, as if the two evaluations were independent: for two models scored on the same
    problems this is conservative).

    >>> round(difference_margin(0.5, 0.5, 200), 4)
    0.098
    >>> difference_margin(1.0, 0.0, 200)
    0.0
    """
    return 1.96 * math.sqrt((first * (1 - first) + second * (1 - second)) / count)


def paired_margin(first: str, second: str) -> float:
    """Half the width of a 95% interval of the difference of two accuracies over the same problems, from which
    problems each got right (strings of 0s and 1s, in the same order): the mean per-problem difference's
    standard error, normal approximation. Tighter than `difference_margin` where the two agree on most problems.

    >>> round(paired_margin("1100", "1000"), 3)  # differences 0, 1, 0, 0: mean 0.25, variance 0.25
    0.49
    >>> paired_margin("1010", "1010")
    0.0
    """
    if len(first) != len(second) or len(first) < 2:
        raise ValueError("paired_margin needs two equally long answer strings of at least 2 problems")
    differences = [int(a) - int(b) for a, b in zip(first, second, strict=True)]
    return 1.96 * math.sqrt(statistics.variance(differences) / len(differences))


def margin(point: Result, baseline: Result, count: int) -> float:
    """The 95% margin of a checkpoint's greedy accuracy against the baseline's: paired where both recorded which
    problems they got right."""
    if "greedy_right" in point and "greedy_right" in baseline:
        return paired_margin(point["greedy_right"], baseline["greedy_right"])
    return difference_margin(point["greedy"], baseline["greedy"], count)


@functools.cache
def unseen(pool_size: int, eval_size: int) -> tuple[int, ...]:
    """Which of the demo task's first `eval_size` held-out problems the first `pool_size` training problems
    lack (their indices): a draw from 672 distinct problems repeats many, so a held-out score is mostly one
    on problems trained on, and these show what carries over to problems never seen.

    >>> len(unseen(1024, 200))
    44
    """
    pool = set(problems(TRAINING_SEED, pool_size))
    return tuple(i for i, problem in enumerate(problems(HELD_OUT_SEED, eval_size)) if problem not in pool)


def unseen_accuracy(point: Result, settings: Result) -> str:
    """A checkpoint's greedy accuracy on the held-out problems the training pool lacks ("—" where the run did
    not record which problems it got right)."""
    if "greedy_right" not in point:
        return "—"
    indices = unseen(settings["pool_size"], settings["eval_size"])
    right = sum(point["greedy_right"][i] == "1" for i in indices)
    return f"{percent(right / len(indices))} of {len(indices)}" if indices else "—"


def seconds_a_step(run: Result) -> str:
    """A run's mean seconds a step, rollout / train ("—" where it recorded no steps). Two configs that sample
    the same completions take the same rollout time on one host: where they do not, the host changed speed
    between them and their steps in the budget do not compare.

    >>> seconds_a_step({"steps": [{"rollout_seconds": 4.0, "train_seconds": 3.0},
    ...                           {"rollout_seconds": 5.0, "train_seconds": 2.0}]})
    '4.5 / 2.5'
    """
    steps = [s for s in run.get("steps", []) if "rollout_seconds" in s]
    if not steps:
        return "—"
    return (f"{statistics.fmean(s['rollout_seconds'] for s in steps):.1f} / "
            f"{statistics.fmean(s['train_seconds'] for s in steps):.1f}")


def ceiling_source(result: Result) -> str:
    """Where a plateau run's ceiling comes from: the ceiling's result file, and its machine where that differs."""
    if "ceiling_file" not in result:
        return "`bench/ceiling.py`"
    elsewhere = not same_kind(result["ceiling_machine"], result["machine"])
    return f"`bench/results/{result['ceiling_file']}`" + (
        f", measured on {describe(result['ceiling_machine'])}" if elsewhere else ", the same kind of machine")


def config_of(key: str) -> str:
    """The config a plateau run key names (`bench/plateau.py` `run_keys`): `clip_higher-2` → `clip_higher`."""
    return key.partition("-")[0]


def baseline_of(key: str, runs: Result) -> Result | None:
    """The run a plateau row is read against: the baseline of its own round (`clip_higher-2` → `baseline-2`).

    >>> runs = {"baseline": "first", "baseline-2": "second"}
    >>> baseline_of("clip_higher", runs), baseline_of("clip_higher-2", runs), baseline_of("curriculum-3", runs)
    ('first', 'second', None)
    """
    _, mark, round_ = key.partition("-")
    return runs.get(f"baseline{mark}{round_}")


def plateau(result_file: str) -> Callable[[Result], str]:
    """The table of one `bench/plateau.py` run (its own file): each config's held-out accuracy at each
    checkpoint, against the baseline of its own round (same machine, problems and budget) and the SFT ceiling; a
    run stopped early shows "—" for the checkpoints it did not reach."""

    def render(result: Result) -> str:
        settings, top = result["settings"], result["ceiling_greedy"]
        checkpoints = settings["checkpoints"]
        compared = "baseline" in result["runs"]
        header = ["config", "before: greedy / T=1"] + [f"{m:g} min: greedy / T=1" for m in checkpoints]
        whole_task = any("greedy_task" in run["checkpoints"][-1] for run in result["runs"].values())
        header.append("last: greedy on unseen problems")
        header += ["last: greedy over the whole task"] if whole_task else []
        header += ["steps", "seconds a step: rollout / train", "groups trained", "zero-variance groups"]
        header += (["last vs baseline"] if compared else []) + ([] if top is None else ["last vs ceiling"])
        rows = []
        for name, run in result["runs"].items():
            points = run["checkpoints"]
            last = points[-1]
            row = [f"`{name}`", f"{percent(run['before']['greedy'])} / {percent(run['before']['sampled'])}"]
            row += [f"{percent(p['greedy'])} / {percent(p['sampled'])}" for p in points]
            row += ["—"] * (len(checkpoints) - len(points))
            row.append(unseen_accuracy(last, settings))
            if whole_task:
                row.append(whole_task_accuracy(last, baseline_of(name, result["runs"])))
            row += [last["steps"], seconds_a_step(run), last.get("groups_trained", "—"),
                    last.get("zero_variance_groups", "—")]
            if compared:
                baseline = baseline_of(name, result["runs"])
                same = [p for p in (baseline or {}).get("checkpoints", []) if p["minutes"] == last["minutes"]]
                if baseline is run or not same:
                    row.append("")
                else:
                    row.append(f"{(last['greedy'] - same[0]['greedy']) * 100:+.1f} ± "
                               f"{margin(last, same[0], settings['eval_size']) * 100:.1f} points")
            if top is not None:
                row.append(f"{(last['greedy'] - top) * 100:+.1f} points")
            rows.append(row)
        parts = [caption(result_file, result, f"{served_model(settings)}, {settings['pool_size']} training problems, "
                         f"{settings['eval_size']} held-out problems, the same problems and wall-clock budget per config"),
                 table(header, rows)]
        stopped = [f"`{name}` stopped {run['stopped']}." for name, run in result["runs"].items() if "stopped" in run]
        if top is not None:
            task_top = result.get("ceiling_greedy_task")
            over_task = f", {percent(task_top)} over the whole task" if task_top is not None else ""
            parts.append(" ".join([f"The SFT ceiling ({ceiling_source(result)}): "
                                   f"{percent(top)} held-out greedy{over_task}.", *stopped]))
        return "\n\n".join(parts)

    return render


ACCURACY_BANDS = ((0.6, 0.7), (0.7, 0.8), (0.8, 0.9), (0.9, 1.0))


def temperature_gap(rl: Sequence[Result], sft: Sequence[Result]) -> str:
    """How far held-out accuracy at temperature 1 trails greedy, by band of greedy accuracy: over every
    checkpoint of the RL runs (`plateau*.json`) and every pass of SFT on the answers (`ceiling*.json`). At the
    same greedy accuracy, a smaller gap is a policy surer of its answers; SFT's gap is what learning the task
    alone leaves."""
    points = {"RL": [c for r in rl for run in r["runs"].values() for c in run["checkpoints"]],
              "SFT": [p for r in sft for p in r["passes"]]}

    def cell(kind: str, low: float, high: float) -> str:
        gaps = [(p["sampled"] - p["greedy"]) * 100 for p in points[kind]
                if low <= p["greedy"] < high or (high == 1.0 and p["greedy"] == 1.0)]
        if not gaps:
            return "—"
        return f"{statistics.fmean(gaps):+.1f} ({min(gaps):+.1f} to {max(gaps):+.1f}, {len(gaps)})"

    rows = [[f"{low:.0%}–{high:.0%}"] + [cell(kind, low, high) for kind in points] for low, high in ACCURACY_BANDS]
    machines = sorted({describe(r["machine"]) for r in [*rl, *sft]})
    return "\n\n".join([
        f"Every checkpoint of `bench/results/plateau*.json` ({len(rl)} files, {len(points['RL'])} checkpoints of "
        f"{sum(len(r['runs']) for r in rl)} runs) and every pass of `bench/results/ceiling*.json` ({len(sft)} "
        f"files), the default model, measured on {'; '.join(machines)}:",
        table(["held-out greedy", "RL: T=1 − greedy, points (range, checkpoints)",
               "SFT: T=1 − greedy, points (range, passes)"], rows)])


def default_model_results(pattern: str) -> list[Result]:
    """The result files matching `pattern` of runs of the default model (no `--model`), by name."""
    loaded = [json.loads(path.read_text(encoding="utf-8")) for path in sorted(RESULTS.glob(pattern))]
    return [result for result in loaded if not result.get("settings", {}).get("model")]


def one_file_tables(make: Callable[[str], Callable[[Result], str]],
                    names: list[str]) -> dict[str, tuple[str, Callable[[Result], str]]]:
    """Tables named after their result file (`name`.json), each made by `make` from that file's name."""
    return {name: (f"{name}.json", make(f"{name}.json")) for name in names}


TABLES: dict[str, tuple[str, Callable[[Result], str]]] = {
    "proxy_overhead": ("proxy_overhead.json", proxy_overhead),
    "proxy_cpu": ("proxy_cpu.json", proxy_cpu),
    "proxy_overhead_dialects": ("proxy_overhead_dialects.json", proxy_overhead_dialects),
    "scale_ceiling": ("scale.json", scale_ceiling),
    "scale_engines": ("scale_engines_pinned.json", scale_engines),
    "scale_capacity": ("scale.json", scale_capacity),
    "soak": ("soak.json", soak),
    "feedback_loop": ("feedback_loop.json", feedback_loop),
    "lora_serving": ("lora_serving.json", lora_serving),
    "engine_start": ("engine_start.json", engine_start),
    "tinker_api": ("tinker_api.json", tinker_api),
    "policy_engine": ("policy_engine.json", policy_engine),
    "train_throughput": ("train_throughput.json", train_throughput),
    "job_learning": ("job_learning.json", job_learning),
    "rl_step": ("rl_step.json", rl_step),
    "rl_step_core_split": ("rl_step.json", rl_step_core_split),
    **one_file_tables(ceiling, ["ceiling", "ceiling_bf16", "ceiling_float32_xeon"]),
    **one_file_tables(plateau, [
        "plateau", "plateau_sampling", "plateau_guidance", "plateau_clip", "plateau_clip_2",
        "plateau_clip_3", "plateau_explore", "plateau_clip_cov", "plateau_clip_cov_2", "plateau_w_reinforce",
        "plateau_entropy_control", "plateau_entropy_control_strong", "plateau_entropy_control_answer",
        "plateau_kl_penalty"]),
}


EMAIL_AGENT_RESULTS = (EMAIL_AGENT / "results-subject-8-inboxes.json",
                       EMAIL_AGENT / "results-subject-8-inboxes-seed1.json")
# Tables of several result files each, and the document each sits in.
EXAMPLE_TABLES: dict[str, tuple[Path, Callable[[], str]]] = {
    "email_agent": (EMAIL_AGENT / "README.md",
                    lambda: email_agent([json.loads(path.read_text(encoding="utf-8")) for path in EMAIL_AGENT_RESULTS])),
    "temperature_gap": (README, lambda: temperature_gap(default_model_results("plateau*.json"),
                                                        default_model_results("ceiling*.json"))),
}


def render(name: str) -> str:
    if name in EXAMPLE_TABLES:
        return EXAMPLE_TABLES[name][1]()
    result_file, make = TABLES[name]
    return make(json.loads((RESULTS / result_file).read_text(encoding="utf-8")))


def generated(text: str) -> str:
    """The document with every marked block replaced by what its result file says."""
    return BLOCK.sub(lambda block: f"{block.group(1)}{render(block.group('name'))}\n{block.group(4)}", text)


def documents() -> dict[Path, set[str]]:
    """Each document with generated tables, and the tables it must hold."""
    named: dict[Path, set[str]] = {README: set(TABLES)}
    for name, (document, _) in EXAMPLE_TABLES.items():
        named.setdefault(document, set()).add(name)
    return named


def main() -> int:
    status = 0
    for document, names in documents().items():
        text = document.read_text(encoding="utf-8")
        document.write_text(generated(text), encoding="utf-8")
        missing = names - {block.group("name") for block in BLOCK.finditer(text)}
        if missing:
            print(f"{document.relative_to(ROOT)} has no block for {sorted(missing)}", file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
