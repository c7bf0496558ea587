"""The measured dtype choice (`artlike_server.dtype_probe`): the rule, the per-machine cache, the real probe."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from artlike_server import dtype_probe
from artlike_server.dtype_probe import (
    BF16_MARGIN,
    ROLES,
    bf16_speedup,
    cache_key,
    cache_path,
    choose,
    load_cached,
    machine_identity,
    probe,
)

# ------------------------------------------------------------------------------------- the choice

# Measured 2048³ matmul peaks on 2-core VMs (GFLOP/s), one shape each.
AMX_XEON = ({"matmul": 909.0}, {"matmul": 215.0})  # (bf16, fp32)
AVX512_BF16_XEON_NO_AMX = ({"matmul": 212.0}, {"matmul": 408.0})
AVX512_BF16_EPYC = ({"matmul": 410.0}, {"matmul": 187.0})  # the machine these tests were written on
AVX2_EPYC_EMULATED: tuple[dict[str, float], dict[str, float]] = ({}, {"matmul": 72.0})  # bf16 never timed


@pytest.mark.parametrize(
    ("measured", "dtype"),
    [
        (AMX_XEON, "bfloat16"),  # 4.2x
        (AVX512_BF16_XEON_NO_AMX, "float32"),  # 0.52x: "native bf16" by the flags, slower in fact
        (AVX512_BF16_EPYC, "bfloat16"),  # 2.2x
        (AVX2_EPYC_EMULATED, "float32"),  # emulated: bf16 not measured at all
    ],
)
def test_the_measured_machines_get_the_faster_dtype(
    measured: tuple[dict[str, float], dict[str, float]], dtype: str
) -> None:
    assert choose(bf16_speedup(*measured)) == dtype


def test_bf16_must_win_by_the_margin_and_a_near_tie_goes_to_float32() -> None:
    assert BF16_MARGIN == 1.15
    assert choose(1.10) == "float32"  # 10% faster: within a shared VM's noise; fp32 is the exact one
    assert choose(BF16_MARGIN) == "bfloat16"
    assert choose(1.0) == choose(0.5) == choose(None) == "float32"


def test_the_speedup_is_the_median_of_the_shapes_ratios() -> None:
    fp32 = {"a": 100.0, "b": 100.0, "c": 100.0}
    # one shape a busy neighbour disturbed (0.2x) does not decide against two clear 2x wins
    assert bf16_speedup({"a": 200.0, "b": 20.0, "c": 210.0}, fp32) == pytest.approx(2.0)
    # an even count: the geometric mean of the middle two
    assert bf16_speedup({"a": 100.0, "b": 400.0}, {"a": 100.0, "b": 100.0}) == pytest.approx(2.0)
    # only shapes timed in both dtypes count (bf16 stopped early); none: no speed-up at all
    assert bf16_speedup({"a": 50.0}, fp32) == pytest.approx(0.5)
    assert bf16_speedup({}, fp32) is None


# ------------------------------------------------------------------------------------- the cache

FAKE_RESULT = {"engine": "float32", "trainer": "bfloat16", "speedup": {"engine": 1.05, "trainer": 1.9},
               "gflops": {}, "bf16_emulated": False}


@pytest.fixture
def fake_python(tmp_path: Path) -> tuple[str, Path]:
    """A stand-in for `python -m artlike_server.dtype_probe --json ...`: prints a fixed result and counts its runs."""
    runs = tmp_path / "runs"
    script = tmp_path / "fake-python"
    script.write_text(f"#!/bin/sh\necho run >> {runs}\necho '{json.dumps(FAKE_RESULT)}'\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script), runs


def run_count(runs: Path) -> int:
    return len(runs.read_text().splitlines()) if runs.exists() else 0


def test_a_miss_measures_and_caches_and_a_hit_does_not_measure(fake_python: tuple[str, Path], tmp_path: Path) -> None:
    python, runs = fake_python
    path = tmp_path / "cache" / "dtype_probe.json"
    first = probe(threads=2, python=python, path=path)
    assert first is not None and first["cached"] is False and run_count(runs) == 1
    assert (first["engine"], first["trainer"]) == ("float32", "bfloat16")
    assert first["threads"] == 2 and first["cpu_model"] and first["flags_hash"]  # the machine, recorded
    second = probe(threads=2, python=python, path=path)
    assert second is not None and second["cached"] is True and run_count(runs) == 1
    assert {k: second[k] for k in ROLES} == {k: first[k] for k in ROLES}
    assert [p.name for p in path.parent.iterdir()] == ["dtype_probe.json"]  # no temp file left behind
    probe(threads=2, python=python, path=path, refresh=True)  # --fresh measures again
    assert run_count(runs) == 2


def test_a_corrupt_cache_is_measured_again_not_an_error(fake_python: tuple[str, Path], tmp_path: Path) -> None:
    python, runs = fake_python
    path = tmp_path / "dtype_probe.json"
    for corrupt in ("{not json", "[1, 2]", '{"entries": {"k": {"engine": "fp8"}}}', ""):
        path.write_text(corrupt)
        before = run_count(runs)
        result = probe(threads=2, python=python, path=path)
        assert result is not None and result["cached"] is False and run_count(runs) == before + 1
        assert load_cached(path, cache_key(machine_identity(2))) is not None  # and written back whole


def test_another_key_measures_again_and_keeps_both(fake_python: tuple[str, Path], tmp_path: Path) -> None:
    python, runs = fake_python
    path = tmp_path / "dtype_probe.json"
    probe(threads=2, python=python, path=path)
    probe(threads=1, python=python, path=path)  # another thread count: another measurement
    assert run_count(runs) == 2
    entries = json.loads(path.read_text())["entries"]
    assert sorted(json.loads(key)["threads"] for key in entries) == [1, 2]
    # a new torch (or CPU, or probe version) is another key: the old entry no longer answers
    changed = machine_identity(2) | {"torch_version": "99.0"}
    assert load_cached(path, cache_key(changed)) is None
    assert load_cached(path, cache_key(machine_identity(2))) is not None


def test_a_probe_that_fails_gives_none_and_caches_nothing(tmp_path: Path) -> None:
    failing = tmp_path / "failing-python"
    failing.write_text("#!/bin/sh\necho 'Illegal instruction' >&2\nexit 132\n")
    failing.chmod(0o755)
    path = tmp_path / "dtype_probe.json"
    assert probe(threads=2, python=str(failing), path=path) is None
    assert probe(threads=2, python=str(tmp_path / "missing"), path=path) is None
    assert not path.exists()


def test_a_result_measured_on_busy_cores_is_used_but_not_cached(tmp_path: Path) -> None:
    busy = tmp_path / "busy-python"
    busy.write_text(f"#!/bin/sh\necho '{json.dumps(FAKE_RESULT | {'busy': True, 'other_load': 0.66})}'\n")
    busy.chmod(0o755)
    path = tmp_path / "dtype_probe.json"
    result = probe(threads=2, python=str(busy), path=path)
    assert result is not None and result["trainer"] == "bfloat16" and not path.exists()
    assert "66% of the cores" in dtype_probe.summary(result, "trainer")


def test_the_cache_lives_in_the_artlike_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("ARTLIKE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_path() == tmp_path / "xdg" / "artlike" / "dtype_probe.json"
    monkeypatch.setenv("ARTLIKE_CACHE_DIR", str(tmp_path / "own"))
    assert cache_path() == tmp_path / "own" / "dtype_probe.json"


def test_the_parent_side_never_imports_torch(fake_python: tuple[str, Path], tmp_path: Path) -> None:
    python, _ = fake_python
    check = ("import sys, pathlib; from artlike_server.dtype_choice import choose_dtypes; "
             "from artlike_server.dtype_probe import probe; "
             f"r = choose_dtypes({{'engine': 'auto', 'trainer': 'auto'}}, 'cpu', run_probe=lambda: probe("
             f"python={python!r}, path=pathlib.Path({str(tmp_path / 'c.json')!r}))); "
             "print(r['engine'].source, r['trainer'].dtype, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["probe", "bfloat16", "False"], done.stderr


# ------------------------------------------------------------------------------------- the real probe


def test_the_real_probe_runs_in_a_few_seconds_and_its_answer_follows_its_numbers(tmp_path: Path) -> None:
    """Runs on any CPU (AMX, AVX-512 BF16, AVX2 with bf16 emulated): the shape of the answer, never a dtype."""
    path = tmp_path / "dtype_probe.json"
    result = probe(path=path, threads=min(2, len(os.sched_getaffinity(0))), timeout_s=60)
    assert result is not None, "the probe subprocess failed (see the log)"
    assert result["seconds"] < 30
    for role in ROLES:
        fp32 = result["gflops"][role]["float32"]
        assert len(fp32) >= 3 and all(rate > 0 for rate in fp32.values()), result
        bf16 = result["gflops"][role].get("bfloat16", {})
        assert set(bf16) <= set(fp32)
        if result["bf16_emulated"]:
            assert not bf16 and result[role] == "float32"
        speedup = result["speedup"][role]
        if speedup is None:
            assert not bf16
        else:  # recomputed from the rounded rates
            assert speedup == pytest.approx(bf16_speedup(bf16, fp32), rel=0.05)
        assert result[role] == choose(speedup)
    assert result["engine_kernel"] in ("torch linear",) or result["engine_kernel"].startswith("vllm onednn_mm")
    assert isinstance(result["busy"], bool) and result["attempts"] in (1, 2)
    cached = load_cached(path, cache_key(machine_identity(result["threads"])))
    assert (cached is None) == result["busy"]  # a measurement on busy cores is not kept
    assert dtype_probe.is_result(result)
