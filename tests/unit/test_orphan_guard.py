"""The shim every engine starts through (orphan_guard.py): the parent-death signal and core binding."""

from __future__ import annotations

import os
import subprocess
import sys

PRINT_AFFINITY = "import os; print(sorted(os.sched_getaffinity(0)))"


def guard(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "artlike_server.orphan_guard", str(os.getpid()), *args],
                          capture_output=True, text=True, timeout=60)


def test_cpus_bind_the_command_and_what_it_starts() -> None:
    first = min(os.sched_getaffinity(0))
    nested = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {PRINT_AFFINITY!r}])"
    result = guard("--cpus", str(first), "--", sys.executable, "-c", nested)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str([first])  # the grandchild (vLLM's EngineCore, say) inherits it


def test_without_cpus_the_command_keeps_every_core() -> None:
    result = guard("--", sys.executable, "-c", PRINT_AFFINITY)
    assert result.stdout.strip() == str(sorted(os.sched_getaffinity(0)))


def test_a_malformed_command_line_is_refused() -> None:
    result = guard("--cpus", "0", sys.executable)
    assert result.returncode == 2 and "usage" in result.stderr
