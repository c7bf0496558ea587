"""The sandbox's limits, each proven: no network (a local server sees no connection), no data dir, no writes
outside the private temp dir, infinite loops and CPU hogs killed, a memory bomb and a fork bomb contained,
the caller's event loop responsive meanwhile, and compile-time checks that never run the code."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import psutil
import pytest
from artlike_server.jobs.sandbox import CodeError, Sandbox, SandboxLimits, check_program

REPOSITORY = Path(__file__).resolve().parents[2]
LIMITS = SandboxLimits(call_timeout_s=3.0, memory_bytes=512 << 20, cpu_seconds_per_call=1, workers=2)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data")
    (path / "secret.txt").write_text("the api key")
    return path


@pytest.fixture(scope="module")
async def sandbox(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> AsyncIterator[Sandbox]:
    box = Sandbox(tmp_path_factory.mktemp("sandbox"), hidden_paths=[data_dir], limits=LIMITS)
    await box.start()
    yield box
    await box.close()


def exists(path: Path | str) -> bool:
    return os.path.exists(path)


def needs(sandbox: Sandbox, what: str) -> None:
    state = sandbox.enforcement()[what]
    if "NOT" in state:
        pytest.skip(f"{what}: {state}")


async def test_a_reward_gets_its_arguments_and_prints_do_not_break_the_protocol(sandbox: Sandbox) -> None:
    source = ("import re, json, statistics\n"
              "def reward_fn(completion, **kwargs):\n"
              "    print('debugging', completion)\n"
              "    return float(kwargs['expected'] in completion[0]['content'])\n")
    result = await sandbox.call(source, "reward_fn", [[{"role": "assistant", "content": "it is 4"}]], {"expected": "4"})
    assert result.failure is None and result.value == 1.0


async def test_an_exception_reports_the_users_line(sandbox: Sandbox) -> None:
    result = await sandbox.call("def f():\n    x = 0\n    return 1 / x\n", "f")
    assert result.failure is not None and result.failure.kind == "raised"
    assert result.failure.message == "ZeroDivisionError: division by zero"
    assert result.failure.traceback is not None and 'File "<reward>", line 3, in f' in result.failure.traceback
    missing = await sandbox.call("def f():\n    return 1\n", "g")
    assert missing.failure is not None and missing.failure.kind == "load_failed" and "'g'" in missing.failure.message
    odd = await sandbox.call("def f():\n    return object()\n", "f")
    assert odd.failure is not None and odd.failure.kind == "unserializable"
    nan = await sandbox.call("def f():\n    return float('nan')\n", "f")
    assert nan.failure is None and nan.value != nan.value  # NaN reaches the caller, which decides


async def test_no_network_not_even_this_machine(sandbox: Sandbox) -> None:
    needs(sandbox, "network")
    connections = 0

    async def count(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        writer.close()

    server = await asyncio.start_server(count, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    source = f"import socket\ndef f():\n    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n    return 'connected'\n"
    async with server:
        result = await sandbox.call(source, "f")
    assert result.failure is not None and result.failure.kind == "raised", result
    assert "unreachable" in result.failure.message or "refused" in result.failure.message
    assert connections == 0


async def test_the_data_dir_is_not_readable(sandbox: Sandbox, data_dir: Path) -> None:
    needs(sandbox, "data_dir")
    read = await sandbox.call(f"def f():\n    return open('{data_dir}/secret.txt').read()\n", "f")
    assert read.failure is not None and ("FileNotFoundError" in read.failure.message
                                         or "PermissionError" in read.failure.message)
    listed = await sandbox.call(f"import os\ndef f():\n    return os.listdir('{data_dir}')\n", "f")
    assert listed.failure is not None or listed.value == []


async def test_the_private_temp_dir_is_the_only_writable_place(sandbox: Sandbox, tmp_path: Path) -> None:
    needs(sandbox, "writable")
    repository = REPOSITORY
    for target in (repository / "pwned.txt", tmp_path / "pwned.txt", Path("/var/tmp/pwned.txt")):
        result = await sandbox.call(f"def f():\n    open('{target}', 'w').write('x')\n", "f")
        assert result.failure is not None and result.failure.kind == "raised", target
        assert not exists(target)
    here = await sandbox.call("import os, tempfile\ndef f():\n    open('mine.txt', 'w').write('x')\n"
                              "    tempfile.NamedTemporaryFile(delete=False).write(b'y')\n"
                              "    return os.getcwd(), sorted(os.listdir('.'))[:1]\n", "f")
    assert here.failure is None and here.value[1] == ["mine.txt"]
    assert not exists("/tmp/mine.txt")


async def test_an_infinite_loop_is_killed_and_the_loop_stays_responsive(sandbox: Sandbox) -> None:
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.05)
            ticks += 1

    ticker = asyncio.create_task(tick())
    started = time.monotonic()
    result = await sandbox.call("def f():\n    while True:\n        pass\n", "f")
    elapsed = time.monotonic() - started
    ticker.cancel()
    assert result.failure is not None and result.failure.kind in {"timeout", "killed"}
    assert elapsed < LIMITS.call_timeout_s + 2
    assert ticks >= elapsed / 0.05 * 0.5  # the caller's event loop kept running meanwhile
    after = await sandbox.call("def f():\n    return 'next'\n", "f")
    assert after.value == "next"


async def test_cpu_time_is_limited_per_call(tmp_path: Path) -> None:
    box = Sandbox(tmp_path, limits=SandboxLimits(call_timeout_s=20.0, cpu_seconds_per_call=1, workers=1))
    started = time.monotonic()
    result = await box.call("def f():\n    while True:\n        pass\n", "f")
    await box.close()
    assert result.failure is not None and result.failure.kind == "killed"
    assert "CPU" in result.failure.message and time.monotonic() - started < 10


async def test_a_memory_bomb_fails_and_the_next_call_works(sandbox: Sandbox) -> None:
    for bomb in ("def f():\n    return len(bytearray(4 << 30))\n",
                 "def f():\n    chunks = []\n    while True:\n        chunks.append(bytearray(64 << 20))\n"):
        result = await sandbox.call(bomb, "f")
        assert result.failure is not None and result.failure.kind in {"raised", "killed"}, result
    assert (await sandbox.call("def f():\n    return 2 + 2\n", "f")).value == 4


async def test_a_fork_bomb_is_contained_and_leaves_nothing_behind(sandbox: Sandbox) -> None:
    needs(sandbox, "processes")
    source = ("import os, time\n"
              "def f():\n"
              "    forked = 0\n"
              "    while True:\n"
              "        try:\n"
              "            if os.fork() == 0:\n"
              "                time.sleep(60)\n"
              "                os._exit(0)\n"
              "        except OSError:\n"
              "            return forked\n"
              "        forked += 1\n")
    result = await sandbox.call(source, "f")
    assert result.failure is None and result.value < LIMITS.max_processes
    await asyncio.sleep(0.5)
    mine = {os.getpid(), *(p.pid for p in psutil.Process().children(recursive=True))}
    sleepers = [p for p in psutil.process_iter(["uids", "pid"])
                if p.info["uids"] and p.info["uids"].real in sandbox.worker_uids
                and p.info["pid"] not in mine and p.status() != psutil.STATUS_ZOMBIE]
    assert sleepers == []
    assert (await sandbox.call("def f():\n    return 'still here'\n", "f")).value == "still here"


def test_check_program_compiles_without_running(tmp_path: Path) -> None:
    marker = tmp_path / "ran.txt"
    source = f"open('{marker}', 'w').write('x')\n\ndef reward_fn(completion, **kwargs):\n    return 1.0\n"
    assert check_program(source, require_one_of=("reward_fn",)) == {"reward_fn"}
    assert not marker.exists()
    with pytest.raises(CodeError) as error:
        check_program("def reward_fn(completion):\n    return (\n", require_one_of=("reward_fn",))
    assert error.value.line == 2 and str(error.value).startswith("line 2:")
    with pytest.raises(CodeError, match="reward_fn"):
        check_program("def score():\n    return 1\n", require_one_of=("reward_fn", "grade"))


def test_enforcement_says_what_holds_here(tmp_path: Path) -> None:
    report = Sandbox(tmp_path).enforcement()
    assert set(report) >= {"isolation", "user_code", "network", "data_dir", "writable", "uid", "processes", "memory",
                           "cpu", "wall_clock", "sharing"}
    assert report["isolation"] in {"root", "userns", "none"}


async def test_the_temp_dir_is_bounded(sandbox: Sandbox) -> None:
    needs(sandbox, "writable")
    source = ("def f():\n"
              "    written = 0\n"
              "    try:\n"
              "        for i in range(100):\n"
              "            with open(f'chunk{i}', 'wb') as out:\n"
              "                out.write(b'x' * (8 << 20))\n"
              "            written += 8\n"
              "    except OSError as error:\n"
              "        return written, error.errno\n"
              "    return written, None\n")
    result = await sandbox.call(source, "f")
    assert result.failure is None, result
    written, errno = result.value
    assert errno is not None and written <= LIMITS.temp_bytes >> 20  # ENOSPC before the disk notices
