"""How the engine's and the trainer's dtypes are decided (`artlike_server.dtype_choice`): explicit, the measured
probe for each role, or the CPU-flags rule where the probe cannot run."""

from __future__ import annotations

from typing import Any

import pytest
from artlike_server.dtype_choice import DtypeChoice, choose_dtypes, decide_dtype, resolve_dtype
from artlike_server.hardware import cpu_flags, cpu_has_native_bf16, cpu_model

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


# A `dtype_probe.probe()` answer in which the roles differ (made up: bf16 winning the engine's small,
# memory-bound decode GEMMs by its halved bytes while losing the trainer's large ones).
PROBED = {"engine": "bfloat16", "trainer": "float32", "speedup": {"engine": 1.3, "trainer": 0.52},
          "bf16_emulated": False, "cached": True}


def test_auto_on_a_cpu_follows_the_probe_for_each_role_over_the_flags() -> None:
    engine = decide_dtype("auto", "cpu", role="engine", probe=PROBED, cpuinfo=EPYC_AVX2)
    trainer = decide_dtype("auto", "cpu", role="trainer", probe=PROBED, cpuinfo=SAPPHIRE_RAPIDS)
    assert (engine.dtype, engine.source) == ("bfloat16", "probe")  # though the flags say no bf16
    assert (trainer.dtype, trainer.source) == ("float32", "probe")  # though the flags say AMX
    assert "0.52x" in trainer.why and "cached" in trainer.why
    assert resolve_dtype("auto", "cpu", role="trainer", probe=PROBED, cpuinfo=SAPPHIRE_RAPIDS) == "float32"


def test_without_a_probe_result_auto_falls_back_to_the_flags_and_says_so() -> None:
    for probe in (None, {}, {"engine": "fp8"}):
        choice = decide_dtype("auto", "cpu", role="engine", probe=probe, cpuinfo=SAPPHIRE_RAPIDS)
        assert (choice.dtype, choice.source) == ("bfloat16", "flags")
    assert decide_dtype("auto", "cpu", cpuinfo=EPYC_AVX2).describe().startswith("float32 (flags: ")


def test_explicit_and_cuda_choices_say_where_they_came_from() -> None:
    assert decide_dtype("float32", "cpu", role="trainer", probe=PROBED) == DtypeChoice("float32", "explicit", "requested")
    assert decide_dtype("auto", "cuda", probe=PROBED).source == "cuda"


def test_choose_dtypes_runs_the_probe_once_and_only_for_auto_on_a_cpu() -> None:
    calls: list[int] = []

    def run_probe() -> dict[str, Any]:
        calls.append(1)
        return PROBED

    both = choose_dtypes({"engine": "auto", "trainer": "auto"}, "cpu", run_probe=run_probe)
    assert ({r: c.dtype for r, c in both.items()}, len(calls)) == ({"engine": "bfloat16", "trainer": "float32"}, 1)
    mixed = choose_dtypes({"engine": "float32", "trainer": "auto"}, "cpu", run_probe=run_probe)
    assert (mixed["engine"].source, mixed["trainer"].source, len(calls)) == ("explicit", "probe", 2)
    choose_dtypes({"engine": "bfloat16", "trainer": "float32"}, "cpu", run_probe=run_probe)
    choose_dtypes({"engine": "auto", "trainer": "auto"}, "cuda", run_probe=run_probe)
    assert len(calls) == 2
    failed = choose_dtypes({"engine": "auto", "trainer": "auto"}, "cpu", run_probe=lambda: None)
    assert {c.source for c in failed.values()} == {"flags"}
    with pytest.raises(ValueError, match="dtype must be one of"):
        choose_dtypes({"engine": "fp8", "trainer": "auto"}, "cpu", run_probe=run_probe)
