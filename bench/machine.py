"""What a benchmark result was measured on, recorded in every result file and named under every table."""

from __future__ import annotations

import os
import platform
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


def describe(recorded: Mapping[str, Any]) -> str:
    """`AMD EPYC, 2 cores, AVX-512 with BF16`: a result file's machine as a table's caption names it."""
    cores = recorded.get("cores") or recorded.get("cpus")
    return ", ".join(str(part) for part in (recorded["cpu"], cores and f"{cores} cores", recorded.get("isa")) if part)
