"""What a benchmark result was measured on, recorded in every result file and named under every table."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Mapping
from typing import Any

from artlike_server.hardware import cpu_flags, cpu_model


def instruction_sets(flags: frozenset[str]) -> str:
    """The vector instructions that decide a CPU's matmul speed, and so which dtype `auto` picks."""
    if "avx512f" in flags:
        described = "AVX-512 with BF16" if "avx512_bf16" in flags else "AVX-512, no BF16"
    else:
        described = "AVX2, no native BF16" if "avx2" in flags else "no AVX2"
    return described + (", AMX" if "amx_tile" in flags else "")


def machine() -> dict[str, Any]:
    return {"platform": platform.platform(), "python": platform.python_version(), "cpu": cpu_model(),
            "cores": os.cpu_count(), "isa": instruction_sets(cpu_flags())}


def same_kind(recorded: Mapping[str, Any], other: Mapping[str, Any]) -> bool:
    """Whether two recorded machines are described the same: CPU model, cores and instruction sets. The kernel
    build and Python's patch release differ between hosts of one kind and change no result.

    >>> a = {"cpu": "AMD EPYC", "cores": 2, "isa": "AVX2, no native BF16", "platform": "Linux-6.18-v1"}
    >>> same_kind(a, {**a, "platform": "Linux-6.18-v2"}), same_kind(a, {**a, "isa": "AVX-512 with BF16"})
    (True, False)
    """
    return describe(recorded) == describe(other)


def matmul_speed(dtype: str = "bfloat16", size: int = 1024, seconds: float = 3.0) -> float:
    """GFLOP/s of square matmuls in `dtype` on every core, for `seconds`: two machines described the same (CPU
    model, cores, instruction sets) can still differ in speed (another generation, a busy host), and a
    wall-clock budget turns that into fewer steps. Run it with nothing else running."""
    import torch  # the bench process may: only the server never imports torch

    a = torch.randn(size, size, dtype=getattr(torch, dtype))
    b = torch.randn(size, size, dtype=getattr(torch, dtype))
    a @ b  # the first call sets up the kernels
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        a @ b
        count += 1
    return round(2 * size**3 * count / (time.perf_counter() - started) / 1e9, 1)


def same_speed(earlier: float, now: float, tolerance: float = 0.15) -> bool:
    """Whether two speeds are within `tolerance` of each other (relative to the larger).

    >>> same_speed(100.0, 90.0), same_speed(100.0, 60.0), same_speed(60.0, 100.0)
    (True, False, False)
    """
    return abs(earlier - now) <= tolerance * max(earlier, now)


def describe(recorded: Mapping[str, Any]) -> str:
    """`AMD EPYC, 2 cores, AVX-512 with BF16`: a result file's machine as a table's caption names it."""
    cores = recorded.get("cores") or recorded.get("cpus")
    return ", ".join(str(part) for part in (recorded["cpu"], cores and f"{cores} cores", recorded.get("isa")) if part)
