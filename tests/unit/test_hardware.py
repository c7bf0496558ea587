"""The dtype rule shared by the engine and the trainer (`artlike_server.hardware`)."""

from __future__ import annotations

import pytest
from artlike_server.hardware import cpu_flags, cpu_has_native_bf16, cpu_model, resolve_dtype

# Abridged /proc/cpuinfo of the two kinds of machine this project has run on.
EPYC_AVX2 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu vme sse sse2 avx f16c fma avx2 bmi2 sha_ni
"""
SAPPHIRE_RAPIDS = """processor\t: 0
vendor_id\t: GenuineIntel
flags\t\t: fpu sse avx avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8
"""
AVX512_NO_BF16 = "flags\t: avx2 avx512f avx512bw avx512vl\n"


def test_flags_are_read_from_the_first_cpu() -> None:
    assert "avx2" in cpu_flags(EPYC_AVX2)
    assert cpu_flags("processor : 0\n") == frozenset()


@pytest.mark.parametrize(
    ("cpuinfo", "native"),
    [(EPYC_AVX2, False), (SAPPHIRE_RAPIDS, True), (AVX512_NO_BF16, False), ("", False)],
)
def test_native_bf16_needs_avx512_bf16_or_amx(cpuinfo: str, native: bool) -> None:
    assert cpu_has_native_bf16(cpuinfo) is native


def test_auto_is_float32_on_a_cpu_that_emulates_bf16() -> None:
    assert resolve_dtype("auto", "cpu", cpuinfo=EPYC_AVX2) == "float32"
    assert resolve_dtype("auto", "cpu", cpuinfo=SAPPHIRE_RAPIDS) == "bfloat16"
    assert resolve_dtype("auto", "cuda", cpuinfo=EPYC_AVX2) == "bfloat16"


def test_an_explicit_dtype_wins_and_a_bad_one_is_refused() -> None:
    assert resolve_dtype("bfloat16", "cpu", cpuinfo=EPYC_AVX2) == "bfloat16"
    assert resolve_dtype("float32", "cuda") == "float32"
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("fp8", "cpu")


def test_cpu_model_reads_the_first_model_name() -> None:
    cpuinfo = "processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu avx2\n\nprocessor\t: 1\nmodel name\t: other\n"
    assert cpu_model(cpuinfo) == "AMD EPYC 7B13"
    assert cpu_model("processor\t: 0\n") == "unknown"
