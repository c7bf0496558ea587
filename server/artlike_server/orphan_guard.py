"""Run a command that dies with its parent: `python -m artlike_server.orphan_guard PARENT_PID [--cpus LIST] -- CMD...`.

The supervisor starts vLLM through this shim. It asks Linux to send SIGTERM to this process when the
parent (the artlike proxy) dies, however it dies (SIGKILL and OOM kills included), then replaces itself
with CMD; the request survives exec. vLLM's API server handles SIGTERM by shutting down its engine core,
so no engine is left holding memory and cores after the proxy is gone. Doing it here rather than in a
`preexec_fn` keeps the fork of a threaded process free of Python code.

`--cpus 0-3` also binds the command (and every process it starts) to those cores before the exec. The
engine's compute threads are bound by vLLM itself (VLLM_CPU_OMP_THREADS_BIND), but its API server and
EngineCore processes are not: unbound, an engine "on core 0" keeps the other core busy too
(bench/scale.py measures it), so two engines on two cores fight over both.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_EXIT_PARENT_GONE = 75  # EX_TEMPFAIL: the parent died before the guard was in place


def set_parent_death_signal(signum: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(errno)}")


def main(argv: list[str]) -> int:
    cpus: set[int] | None = None
    if len(argv) >= 3 and argv[1] == "--cpus":
        cpus = {int(cpu) for cpu in argv[2].split(",")}
        argv = [argv[0], *argv[3:]]
    if len(argv) < 3 or argv[1] != "--":
        print(
            "usage: python -m artlike_server.orphan_guard PARENT_PID [--cpus 0,1] -- COMMAND [ARGS...]",
            file=sys.stderr,
        )
        return 2
    parent_pid, command = int(argv[0]), argv[2:]
    if cpus is not None:
        os.sched_setaffinity(0, cpus)  # inherited by everything the command starts
    set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect: no signal would come
        return _EXIT_PARENT_GONE
    os.execvp(command[0], command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
