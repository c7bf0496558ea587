"""Sandbox workers share nothing between jobs: one job's memory, monkeypatches or forged protocol lines never
reach another job's calls, a failed call retires its worker, and graders/run never reuses a worker. On the
real Sandbox (its worker processes, as the server starts them)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from artlike_server.jobs.rewards import python_grader_runner
from artlike_server.jobs.sandbox import Sandbox, SandboxLimits

LIMITS = SandboxLimits(call_timeout_s=2.0, workers=1)
VM_SIZE = "def f():\n    return int(open('/proc/self/status').read().split('VmSize:')[1].split()[0]) >> 10\n"


@pytest.fixture
async def sandbox(tmp_path: Path) -> AsyncIterator[Sandbox]:
    box = Sandbox(tmp_path / "sandbox", limits=LIMITS)
    yield box
    await box.close()


async def test_a_jobs_big_global_stays_in_its_own_workers(sandbox: Sandbox) -> None:
    hog = "BIG = bytearray(700 << 20)\n" + VM_SIZE
    await sandbox.call(hog, "f", owner="job-a")  # a MemoryError here (a small address space) retires it too
    other = await sandbox.call(VM_SIZE, "f", owner="job-b")
    assert other.failure is None and other.value < 300, other  # MiB of address space: none of job A's


async def test_a_monkeypatch_does_not_reach_another_jobs_calls(sandbox: Sandbox) -> None:
    patch = ("import json, builtins\n"
             "json.dumps = lambda *a, **k: '\"pwned\"'\n"
             "builtins.len = lambda x: 42\n"
             "def f():\n    return 1\n")
    await sandbox.call(patch, "f", owner="job-a")  # its own reply may break: its worker is its own
    clean = "import json\ndef f():\n    return json.dumps([1]), len([1, 2])\n"
    assert (await sandbox.call(clean, "f", owner="job-b")).value == ["[1]", 2]
    # Nor another source of the same job (a python grader next to its reward, say).
    assert (await sandbox.call(clean, "f", owner="job-a")).value == ["[1]", 2]


async def test_a_forged_protocol_line_is_not_taken_as_a_reply(sandbox: Sandbox) -> None:
    forge = ("import json, os\n"
             "def f():\n"
             "    lines = ''.join(json.dumps({'id': i, 'ok': True, 'value': 'forged'}) + '\\n' for i in range(100))\n"
             "    print(lines)\n"
             "    for fd in range(256):\n"
             "        try:\n"
             "            os.write(fd, lines.encode())\n"
             "        except OSError:\n"
             "            pass\n"
             "    return 'real'\n")
    first = await sandbox.call(forge, "f", owner="job-a")
    assert first.value != "forged"  # 'real', or a failure: the worker broke its own reply channel
    for owner in ("job-a", "job-b"):
        after = await sandbox.call("def f():\n    return 'own'\n", "f", owner=owner)
        assert after.value == "own", after


async def test_a_failed_call_retires_its_worker(sandbox: Sandbox) -> None:
    source = ("CALLS = []\n"
              "def f(fail):\n"
              "    CALLS.append(1)\n"
              "    if fail:\n"
              "        raise ValueError('once')\n"
              "    return len(CALLS)\n")
    assert (await sandbox.call(source, "f", [False], owner="job-a")).value == 1
    assert (await sandbox.call(source, "f", [False], owner="job-a")).value == 2  # warm: the same worker
    assert (await sandbox.call(source, "f", [True], owner="job-a")).failure is not None
    assert (await sandbox.call(source, "f", [False], owner="job-a")).value == 1  # a fresh one


async def test_graders_run_never_reuses_a_worker(sandbox: Sandbox) -> None:
    run = python_grader_runner(sandbox)
    source = "SEEN = []\ndef grade(sample, item):\n    SEEN.append(1)\n    return float(len(SEEN))\n"
    assert await run(source, {}, {}) == 1.0
    assert await run(source, {}, {}) == 1.0
    await sandbox.call(source, "grade", [{}, {}], owner="job-a")
    assert await run(source, {}, {}) == 1.0
