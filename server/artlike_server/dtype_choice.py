"""Which floating-point type this machine runs fast, for the engine and for the trainer.

    decide_dtype("auto", "cpu", role="engine", probe=result) -> the probe's measured choice for that role
    decide_dtype("auto", "cpu", role="trainer")              -> the CPU-flags rule (no measurement to go on)
    decide_dtype("auto", "cuda", ...)                        -> bfloat16
    decide_dtype("float32", ...)                             -> float32 (explicit)

On a CPU, "auto" follows a measurement (`dtype_probe`: bf16 vs fp32 GEMMs shaped like each role's work,
run in a subprocess and cached per machine), because the flags do not say which is fast: an AVX-512 BF16 Xeon
without AMX runs bf16 slower than fp32 despite "native bf16", and an AVX2-only CPU emulates bf16 (the
machines in tests/unit/test_dtype_probe.py; `python -m artlike_server.dtype_probe` measures this one).

Where the probe cannot run, the flags rule is the fallback: bf16 on CPUs whose flags the kernel reports
include AVX-512 BF16 or AMX (what torch's CPU kernels dispatch on, `torch.cpu._is_avx512_bf16_supported()`
or `_is_amx_tile_supported()`), else float32. Where no flags can be read it answers float32: slower on a
bf16 CPU, never catastrophically slow. Nothing here imports torch: the proxy process never does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from . import dtype_probe
from .hardware import DTYPE_CHOICES, Dtype, Role, Source, cpu_has_native_bf16


@dataclass(frozen=True)
class DtypeChoice:
    """One role's dtype and where it came from: "explicit" (asked for), "probe" (measured here), "flags" (the
    CPU-flags rule, the probe could not run) or "cuda" (bf16 on a GPU)."""

    dtype: Dtype
    source: Source
    why: str

    def describe(self) -> str:
        return f"{self.dtype} ({self.source}: {self.why})"


def _check(requested: str) -> None:
    if requested not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, not {requested!r}")


def decide_dtype(
    requested: str,
    device: str,
    *,
    role: Role = "engine",
    probe: Mapping[str, Any] | None = None,
    cpuinfo: str | None = None,
) -> DtypeChoice:
    """`role`'s dtype: `requested` unless it is "auto"; then on a CPU the `probe` result's choice for `role`
    (`dtype_probe.probe()`), or the flags rule where there is none. Pure given `probe` and `cpuinfo`."""
    _check(requested)
    if requested != "auto":
        return DtypeChoice("bfloat16" if requested == "bfloat16" else "float32", "explicit", "requested")
    if device == "cuda":
        return DtypeChoice("bfloat16", "cuda", "bf16 on CUDA")
    measured = probe.get(role) if probe is not None else None
    if measured in ("bfloat16", "float32"):
        dtype: Dtype = "bfloat16" if measured == "bfloat16" else "float32"
        return DtypeChoice(dtype, "probe", dtype_probe.summary(probe or {}, role))
    native = cpu_has_native_bf16(cpuinfo)
    why = "no measurement; the CPU flags " + ("include" if native else "lack") + " avx512_bf16/amx"
    return DtypeChoice("bfloat16" if native else "float32", "flags", why)


def resolve_dtype(
    requested: str,
    device: str,
    *,
    cpuinfo: str | None = None,
    role: Role = "engine",
    probe: Mapping[str, Any] | None = None,
) -> Dtype:
    """The dtype to run in (`decide_dtype` without the reason)."""
    return decide_dtype(requested, device, role=role, probe=probe, cpuinfo=cpuinfo).dtype


def choose_dtypes(
    requested: Mapping[Role, str],
    device: str,
    *,
    run_probe: Callable[[], Mapping[str, Any] | None] | None = None,
) -> dict[Role, DtypeChoice]:
    """Each role's dtype, running the dtype probe (`dtype_probe.probe`: cached per machine, else a short
    subprocess) only when some role asks for "auto" on a CPU. A probe that fails leaves the flags rule."""
    for value in requested.values():
        _check(value)
    result: Mapping[str, Any] | None = None
    if device != "cuda" and "auto" in requested.values():
        if run_probe is None:
            run_probe = dtype_probe.probe
        result = run_probe()
    return {role: decide_dtype(value, device, role=role, probe=result) for role, value in requested.items()}
