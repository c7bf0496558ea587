"""What this machine's CPU is: its model name and flags, read from `/proc/cpuinfo` (or a text given).

The dtype vocabulary (`Dtype`, `Role`, `Source`, `DTYPE_CHOICES`) lives here too, below both the measurement
(`dtype_probe`) and the decision (`dtype_choice`). Nothing here imports torch: the proxy process never does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

Dtype = Literal["bfloat16", "float32"]
Role = Literal["engine", "trainer"]
Source = Literal["explicit", "probe", "flags", "cuda"]
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
