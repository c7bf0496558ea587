"""The sandbox escape battery: user code trying each way out, run as `python sandbox_battery.py DIR OWNED`.

It plays the server: a Sandbox hiding DIR/data, with an API key in its own environment, a directory only
its user may write (OWNED, outside /tmp) and a listener on 127.0.0.1. It prints one JSON object: the isolation
mode and, per attempt, whether it was contained (`held`) and what happened. Where the sandbox refuses user
code, every attempt must be refused (503) instead. Run as root and as an ordinary user by
test_sandbox_escape.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from artlike_server.jobs.sandbox import CallResult, Sandbox, SandboxLimits, SandboxUnavailable

MEMORY = 512 << 20
CHILD_MB = 160
SLEEPER = "987.6"  # the argument that marks a process user code tried to leave behind
LIMITS = SandboxLimits(call_timeout_s=5.0, memory_bytes=MEMORY, cpu_seconds_per_call=5, max_processes=8, workers=1)

NETWORK = """
import socket
def f(host, port):
    try:
        socket.create_connection((host, port), timeout=2).close()
    except OSError as error:
        return 'blocked: ' + str(error)
    return 'connected'
"""
ENVIRON = """
import os
def f(pid):
    seen = []
    for name in ['self', str(pid), *os.listdir('/proc')]:
        try:
            seen.append(open(f'/proc/{name}/environ', 'rb').read().decode(errors='replace'))
        except OSError:
            pass
    return '\\n'.join(seen)
"""
LEAVE_BEHIND = """
import os, time
def f(then_hang):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.execv('/bin/sleep', ['sleep', '""" + SLEEPER + """'])
        os._exit(0)
    time.sleep(0.3)
    while then_hang:
        pass
    return 'left'
"""
FORK_BOMB = """
import os, time
def f():
    forked = 0
    while True:
        try:
            if os.fork() == 0:
                time.sleep(60)
                os._exit(0)
        except OSError:
            return forked
        forked += 1
"""
MEMORY_BOMB = """
import os, select, time
def f(children, megabytes):
    # Counts the children alive at the end that had touched their share: the OOM killer may take one that
    # reported and let a later one through, so reports alone overcount what was ever held at once.
    read, write = os.pipe()
    for _ in range(children):
        try:
            if os.fork() == 0:
                try:
                    held = b'x' * (megabytes << 20)  # touched, not just reserved
                    os.write(write, b'%d\\n' % os.getpid())
                    time.sleep(30)
                finally:
                    os._exit(0)
        except OSError:
            break
    reported, deadline = b'', time.monotonic() + 2.5
    while time.monotonic() < deadline:
        if select.select([read], [], [], 0.2)[0]:
            reported += os.read(read, 4096)
    return sum(os.waitpid(int(pid), os.WNOHANG) == (0, 0) for pid in reported.split())
"""
WRITE = """
def f(path):
    try:
        with open(path, 'w') as out:
            out.write('pwned')
    except OSError as error:
        return 'blocked: ' + str(error)
    return 'written'
"""
FORGE = """
import json, os
def f(after):
    forged = ''.join(json.dumps({'id': i, 'ok': True, 'value': 'forged', 'cpu_used': 0}) + '\\n'
                     for i in range(after, after + 50)).encode()
    frame = json.dumps({'ok': True, 'value': 'forged'}).encode()
    frame = len(frame).to_bytes(4, 'big') + frame
    print(forged.decode())
    for fd in range(256):
        for data in (forged, frame):
            try:
                os.write(fd, data)
            except OSError:
                pass
    return 'real'
def g():
    return 'second'
"""
PRIVILEGE = """
import ctypes, os
def f(hidden):
    libc = ctypes.CDLL(None, use_errno=True)
    out = {'caps': [l.split()[1] for l in open('/proc/self/status') if l.startswith('CapEff')][0]}
    out['umount'] = libc.umount2(hidden.encode(), 2) == 0
    out['mount'] = libc.mount(b'tmpfs', b'/mnt', b'tmpfs', 0, None) == 0
    out['userns'] = libc.unshare(0x10000000 | 0x00020000) == 0
    out['hidden_after'] = os.path.exists(hidden + '/secret.txt')
    return out
"""


def sleepers() -> list[int]:
    """Processes anywhere on the machine running the marked sleep."""
    found = []
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and Path(f"/proc/{name}/cmdline").read_bytes().split(b"\0")[:2] == \
                    [b"sleep", SLEEPER.encode()]:
                found.append(int(name))
        except OSError:
            continue
    return found


def verdict(held: bool, detail: Any) -> dict[str, Any]:
    return {"held": bool(held), "detail": detail if isinstance(detail, str | int | float | None) else repr(detail)}


def failed(result: CallResult) -> bool:
    return result.failure is not None


async def battery(root: Path, owned: Path) -> dict[str, Any]:
    data = root / "data"
    box = Sandbox(root / "sandbox", hidden_paths=[data], limits=LIMITS)
    out: dict[str, Any] = {"mode": box.isolation.mode, "enforcement": box.enforcement(), "uid": os.geteuid()}
    results: dict[str, dict[str, Any]] = {}
    out["results"] = results
    if not box.isolated:  # refused: every attempt must be a 503, none may run
        try:
            await box.call(WRITE, "f", [str(owned / "pwned.txt")])
        except SandboxUnavailable as refused:
            results["refused"] = verdict(refused.code == "sandbox_unavailable" and refused.status_code == 503,
                                         refused.message)
        else:
            results["refused"] = verdict(False, "user code ran without isolation")
        results["nothing_written"] = verdict(not (owned / "pwned.txt").exists(), None)
        return out

    connections = 0

    async def count(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        writer.close()

    listener = await asyncio.start_server(count, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    local = await box.call(NETWORK, "f", ["127.0.0.1", port])
    await asyncio.sleep(0.2)
    listener.close()
    results["network_local"] = verdict(not failed(local) and local.value != "connected" and connections == 0,
                                       local.value)
    external = await box.call(NETWORK, "f", ["8.8.8.8", 53])
    results["network_external"] = verdict(not failed(external) and external.value != "connected", external.value)

    read = await box.call("def f(p):\n    return open(p).read()\n", "f", [str(data / "secret.txt")])
    results["data_dir"] = verdict(failed(read) and "data-dir-secret" not in str(read), read.failure)

    key = os.environ["ARTLIKE_API_KEY"]
    environ = await box.call(ENVIRON, "f", [os.getpid()])
    results["proc_environ"] = verdict(not failed(environ) and key not in str(environ.value),
                                      f"{len(str(environ.value))} characters of environ readable")

    for name, hang in (("setsid_outlives_retire", False), ("setsid_outlives_timeout", True)):
        left = await box.call(LEAVE_BEHIND, "f", [hang], owner="battery", timeout_s=2)
        await asyncio.sleep(0.5)
        survivors = sleepers()
        results[name] = verdict(not survivors, f"{left.value or left.failure}; survivors {survivors}")

    bomb = await box.call(FORK_BOMB, "f", owner="battery")
    await asyncio.sleep(0.5)
    results["fork_bomb"] = verdict((failed(bomb) or bomb.value <= LIMITS.max_processes) and not sleepers(),
                                   bomb.value if not failed(bomb) else str(bomb.failure))

    memory = await box.call(MEMORY_BOMB, "f", [6, CHILD_MB])
    held = 0 if failed(memory) else int(memory.value)
    results["memory_bomb"] = verdict(held * CHILD_MB << 20 <= MEMORY,
                                     f"{held} x {CHILD_MB} MiB held at once (budget {MEMORY >> 20} MiB)"
                                     if not failed(memory) else str(memory.failure))

    for name, target in (("write_server_owned", owned / "pwned.txt"),
                         ("write_var_tmp", Path("/var/tmp") / f"artlike-pwned-{os.getpid()}"),
                         ("write_dev_shm", Path("/dev/shm") / f"artlike-pwned-{os.getpid()}")):
        wrote = await box.call(WRITE, "f", [str(target)])
        results[name] = verdict(not target.exists() and wrote.value != "written", wrote.value or wrote.failure)
        target.unlink(missing_ok=True)

    forged = await box.call(FORGE, "f", [0], owner="forger")
    second = await box.call(FORGE, "g", owner="forger")
    after = await box.call("def f():\n    return 'clean'\n", "f", owner="forger")
    values = [forged.value, second.value, after.value]
    results["forged_protocol"] = verdict("forged" not in values and second.value == "second"
                                         and after.value == "clean", values)

    privilege = await box.call(PRIVILEGE, "f", [str(data)])
    p = privilege.value or {}
    results["privileges"] = verdict(not failed(privilege) and not p["umount"] and not p["mount"]
                                    and not p["hidden_after"] and int(p["caps"], 16) == 0, p or privilege.failure)
    await box.close()
    return out


def main() -> None:
    root, owned = Path(sys.argv[1]), Path(sys.argv[2])
    (root / "data").mkdir(exist_ok=True)
    (root / "data" / "secret.txt").write_text("data-dir-secret")
    owned.mkdir(mode=0o700, exist_ok=True)
    started = time.monotonic()
    report = asyncio.run(battery(root, owned))
    report["seconds"] = round(time.monotonic() - started, 2)
    print(json.dumps(report))


if __name__ == "__main__":
    socket.setdefaulttimeout(5)
    main()
