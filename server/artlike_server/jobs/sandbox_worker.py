"""The sandbox's worker process: confine itself, then run user functions one request at a time.

Started by `sandbox.Sandbox` as `[unshare --net --mount --pid --fork --kill-child] python -m
artlike_server.jobs.sandbox_worker CONFIG_JSON`. When it is root in fresh namespaces it first hides the data
dir (an empty, unreadable tmpfs over it), makes a private, size-bounded tmpfs on /tmp the only writable
place (/var/tmp and /dev/shm become empty read-only tmpfs), then sets its rlimits and drops to its own
unprivileged uid. Then it serves JSON lines on stdin/stdout:

    request  {"id", "source", "function", "args", "kwargs", "cpu_seconds"}
    response {"id", "ok": true, "value", "cpu_used"} | {"id", "ok": false, "kind", "message", "traceback"}

The user's prints go to /dev/null (fd 1 and 2), never into the protocol.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import linecache
import os
import resource
import sys
import traceback
from typing import Any

SOURCE_NAME = "<reward>"
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
WORLD_WRITABLE = ("/var/tmp", "/dev/shm", "/run/lock", "/var/lock")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(_c(source), _c(target), _c(fstype), flags, _c(data)) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {target}: {os.strerror(errno)}")


def _umount(target: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.umount2(target.encode(), MNT_DETACH) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"umount {target}: {os.strerror(errno)}")


def _blocked(paths: list[str]) -> dict[str, set[str]]:
    """For each path the worker must read (Python itself, sys.path): the first ancestor others may not enter
    (e.g. /root, mode 700) mapped to its children on the way to those paths (e.g. /root/.pyenv)."""
    blocked: dict[str, set[str]] = {}
    for path in paths:
        if not os.path.exists(path):
            continue
        parts = os.path.realpath(path).split(os.sep)[1:]
        for depth in range(1, len(parts)):
            ancestor = os.sep + os.path.join(*parts[:depth])
            if not os.stat(ancestor).st_mode & 0o001:
                blocked.setdefault(ancestor, set()).add(os.path.join(ancestor, parts[depth]))
                break
    return blocked


def expose(paths: list[str], scratch: str) -> None:
    """Replace each blocked ancestor by a read-only tmpfs holding only the subtrees the worker needs, so an
    unprivileged uid can import Python and the installed packages (and sees nothing else there)."""
    for ancestor, children in _blocked(paths).items():
        stash = os.path.join(scratch, ".stash")
        os.mkdir(stash, 0o700)
        held = []
        for index, child in enumerate(sorted(children)):
            os.mkdir(f"{stash}/{index}")
            _mount(child, f"{stash}/{index}", None, MS_BIND | MS_REC, None)
            held.append((child, f"{stash}/{index}"))
        _mount("tmpfs", ancestor, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=755")
        for child, stashed in held:
            os.makedirs(child, exist_ok=True)
            _mount(stashed, child, None, MS_BIND | MS_REC, None)
            _umount(stashed)
            os.rmdir(stashed)
        os.rmdir(stash)
        _mount(None, ancestor, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None)


def _c(text: str | None) -> bytes | None:
    return text.encode() if text is not None else None


def confine(config: dict[str, Any]) -> None:
    """Namespaces (when the parent could make them), then rlimits, then the unprivileged uid."""
    tmp = config["tmp"]
    if config["isolate"]:
        _mount(None, "/", None, MS_REC | MS_PRIVATE, None)
        expose([p for p in (sys.base_prefix, sys.prefix, *sys.path) if os.path.isabs(p)
                and not os.path.realpath(p).startswith(os.path.dirname(tmp))], tmp)
        for hidden in config["hidden"]:
            if os.path.isdir(hidden):
                _mount("tmpfs", hidden, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=000")
        for path in WORLD_WRITABLE:
            if os.path.isdir(path) and not os.path.islink(path):
                _mount("tmpfs", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=755")
        # The only writable place: an in-memory /tmp of bounded size, so user code cannot fill the disk.
        owner = f",uid={config['uid']},gid={config['uid']}" if config["uid"] is not None else ""
        _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
               f"size={config['limits']['temp_bytes']},mode=700{owner}")
        tmp = "/tmp"
    limits = config["limits"]
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"], limits["memory_bytes"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["max_file_bytes"], limits["max_file_bytes"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_seconds_lifetime"], limits["cpu_seconds_lifetime"]))
    uid = config["uid"]
    if uid is not None:
        resource.setrlimit(resource.RLIMIT_NPROC, (limits["max_processes"], limits["max_processes"]))
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    os.chdir(tmp)
    os.environ.update({"HOME": tmp, "TMPDIR": tmp})


class Programs:
    """User modules, compiled and executed once per worker, by the sha256 of their source."""

    def __init__(self) -> None:
        self._namespaces: dict[str, dict[str, Any]] = {}

    def load(self, source: str) -> dict[str, Any]:
        key = hashlib.sha256(source.encode()).hexdigest()
        namespace = self._namespaces.get(key)
        if namespace is None:
            linecache.cache[SOURCE_NAME] = (len(source), None, source.splitlines(True), SOURCE_NAME)
            namespace = {"__name__": "reward", "__builtins__": __builtins__}
            exec(compile(source, SOURCE_NAME, "exec"), namespace)  # this process is the sandbox
            self._namespaces[key] = namespace
        linecache.cache[SOURCE_NAME] = (len(source), None, source.splitlines(True), SOURCE_NAME)
        return namespace


def user_traceback(error: BaseException) -> str:
    """The exception with only the frames of the user's code (so 'line N' is a line of their source)."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == SOURCE_NAME]
    lines = ["Traceback (most recent call last):\n", *traceback.format_list(frames),
             *traceback.format_exception_only(type(error), error)]
    return "".join(lines).rstrip()


def handle(request: dict[str, Any], programs: Programs) -> dict[str, Any]:
    reply: dict[str, Any] = {"id": request["id"]}
    try:
        namespace = programs.load(request["source"])
    except BaseException as error:  # user code: every failure is reported, none kills the worker
        return reply | {"ok": False, "kind": "load_failed", "message": _one_line(error),
                        "traceback": user_traceback(error)}
    function = namespace.get(request["function"])
    if not callable(function):
        return reply | {"ok": False, "kind": "load_failed", "traceback": None,
                        "message": f"the code defines no function {request['function']!r}"}
    used = _cpu_used()
    resource.setrlimit(resource.RLIMIT_CPU, (int(used + request["cpu_seconds"]) + 1,
                                             resource.getrlimit(resource.RLIMIT_CPU)[1]))
    try:
        value = function(*request["args"], **request["kwargs"])
    except BaseException as error:  # user code, as above (SystemExit and KeyboardInterrupt too)
        return reply | {"ok": False, "kind": "raised", "message": _one_line(error),
                        "traceback": user_traceback(error)}
    try:
        json.dumps(value)
    except (TypeError, ValueError) as error:
        return reply | {"ok": False, "kind": "unserializable", "traceback": None,
                        "message": f"{request['function']} returned a {type(value).__name__}, which is not JSON: "
                                   f"{error}"}
    return reply | {"ok": True, "value": value, "cpu_used": _cpu_used(), "processes": _other_processes()}


def _other_processes() -> int:
    """Processes besides this one in its pid namespace (forked by user code): the parent then retires it."""
    try:
        return sum(1 for name in os.listdir("/proc") if name.isdigit() and int(name) not in {os.getpid(), 1})
    except OSError:
        return 0


def _cpu_used() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _one_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".splitlines()
    return text[0] if text else type(error).__name__


def _wait_as_init(child: int) -> None:
    """PID 1 of the namespace only waits: the kernel does not deliver its own signals (SIGXCPU for the CPU
    limit) to a namespace's init, so the user's code runs in its child; when that child ends, so does
    everything else in the namespace."""
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == child:
            os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))


def main() -> None:
    if os.getpid() == 1:
        child = os.fork()
        if child:
            _wait_as_init(child)
    config = json.loads(sys.argv[1])
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    requests = sys.stdin
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    try:
        confine(config)
    except OSError as error:
        protocol.write(json.dumps({"id": None, "ok": False, "kind": "load_failed", "traceback": None,
                                   "message": f"the sandbox could not confine itself: {error}"}) + "\n")
        return
    protocol.write(json.dumps({"id": None, "ok": True, "value": "ready"}) + "\n")
    programs = Programs()
    for line in requests:
        reply = handle(json.loads(line), programs)
        protocol.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
