"""The sandbox's worker process: confine itself, then run user functions one request at a time.

Started by `sandbox.Sandbox` as `[unshare [--user --map-root-user] --net --mount --pid --fork --kill-child
--mount-proc] python -m artlike_server.jobs.sandbox_worker CONFIG_JSON`. Two processes:

- the supervisor (this process; PID 1 of the namespace when isolated) hides the data dir, makes the file
  system read-only but for a private, size-bounded tmpfs on /tmp, joins the worker's cgroup, and speaks the
  protocol with the server on stdin/stdout. It never runs user code and is not ptrace-able
  (`PR_SET_DUMPABLE 0`), so nothing user code does can write a line the server reads.
- the executor (its child) closes the protocol, drops every privilege (its own uid as root, no
  capabilities and no nested user namespaces inside a user namespace, `no_new_privs`, rlimits) and runs the
  user's code. Its replies reach the supervisor as length-prefixed frames on a private pipe; the supervisor
  checks each one, adds what it measured itself (CPU used, processes left behind) and writes the reply. A
  malformed or unrequested frame kills the executor, so that worker ends.

    request  {"id", "source", "function", "args", "kwargs", "cpu_seconds"}
    response {"id", "ok": true, "value", "cpu_used", "processes"} | {"id", "ok": false, "kind", "message", "traceback"}

The user's prints go to /dev/null (fd 0, 1 and 2 of the executor), never into the protocol.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import linecache
import os
import resource
import select
import signal
import struct
import sys
import traceback
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the worker's start-up time: typing and pathlib cost more than the rest of its imports
    from collections.abc import Sequence
    from typing import Any, BinaryIO

SOURCE_NAME = "<reward>"
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
# statvfs f_flag bit -> the mount flag a read-only remount must keep (the kernel refuses to clear locked ones)
KEPT_FLAGS = {2: MS_NOSUID, 4: MS_NODEV, 8: MS_NOEXEC, 1024: MS_NOATIME, 2048: MS_NODIRATIME, 4096: MS_RELATIME}
MNT_DETACH = 2
PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS = 4, 24, 28, 38
SECURE_ALL_LOCKED = 0x3F  # NOROOT, NO_SETUID_FIXUP, KEEP_CAPS (off), each locked
WORLD_WRITABLE = ("/var/tmp", "/dev/shm", "/run/lock", "/var/lock")
FAILURE_KINDS = {"raised", "unserializable", "load_failed"}
FRAME = struct.Struct("!I")
MAX_FRAME = 16 << 20

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _read(path: str) -> str:
    with open(path) as file:
        return file.read()


def _c(text: str | None) -> bytes | None:
    return text.encode() if text is not None else None


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    _check(_libc.mount(_c(source), _c(target), _c(fstype), flags, _c(data)), f"mount {target}")


def _umount(target: str) -> None:
    _check(_libc.umount2(target.encode(), MNT_DETACH), f"umount {target}")


def _prctl(option: int, value: int, what: str) -> None:
    _check(_libc.prctl(option, value, 0, 0, 0), what)


def _blocked(paths: list[str], masked: list[str]) -> dict[str, set[str]]:
    """For each path the worker must read (Python itself, sys.path): the first ancestor it may not see (one
    others may not enter, e.g. /root mode 700, or one of `masked`, e.g. the server user's home) mapped to its
    children on the way to those paths (e.g. /root/.pyenv)."""
    masked_real = {os.path.realpath(m) for m in masked}
    blocked: dict[str, set[str]] = {m: set() for m in masked_real if os.path.isdir(m)}
    for path in paths:
        if not os.path.exists(path):
            continue
        parts = os.path.realpath(path).split(os.sep)[1:]
        for depth in range(1, len(parts)):
            ancestor = os.sep + os.path.join(*parts[:depth])
            if ancestor in masked_real or not os.stat(ancestor).st_mode & 0o001:
                blocked.setdefault(ancestor, set()).add(os.path.join(ancestor, parts[depth]))
                break
    return blocked


def expose(paths: list[str], scratch: str, masked: Sequence[str] = ()) -> None:
    """Replace each blocked ancestor by a read-only tmpfs holding only the subtrees the worker needs, so it
    can import Python and the installed packages (and sees nothing else there)."""
    for ancestor, children in _blocked(paths, list(masked)).items():
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


def _read_only_everywhere() -> None:
    """Remount every mount read-only: inside a user namespace the worker is the server's own user, whose
    files (the venv, the checkout) file permissions would not protect."""
    for line in _read("/proc/self/mountinfo").splitlines():
        point = line.split()[4].encode().decode("unicode_escape")
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        current = os.statvfs(point).f_flag
        for bit, flag in KEPT_FLAGS.items():
            if current & bit:
                flags |= flag
        _mount(None, point, None, flags, None)


def confine_supervisor(config: dict[str, Any]) -> str:
    """The namespaces' view (when the parent made them) and the cgroup; the cwd the executor gets."""
    for procs in config.get("cgroup_procs") or ():
        with open(procs, "w") as joined:  # the executor and all it forks are counted against the limits
            joined.write("0")
    mode = config["mode"]
    if mode == "none":
        return str(config["tmp"])
    tmp = config["tmp"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE, None)
    python_paths = [p for p in (sys.base_prefix, sys.prefix, *sys.path) if os.path.isabs(p)
                    and not os.path.realpath(p).startswith(os.path.dirname(tmp))]
    if mode == "userns":
        # Only in a user namespace of its own is this limit the worker's alone: no nested namespaces, in
        # which the executor would hold capabilities again.
        with open("/proc/sys/user/max_user_namespaces", "w") as nested:
            nested.write("0")
    expose(python_paths, tmp, config.get("masked") or [])
    for hidden in config["hidden"]:
        if os.path.isdir(hidden):
            _mount("tmpfs", hidden, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=000")
    for path in WORLD_WRITABLE:
        if os.path.isdir(path) and not os.path.islink(path):
            _mount("tmpfs", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=755")
    if mode == "userns":
        _read_only_everywhere()
    # The only writable place: an in-memory /tmp of bounded size, so user code cannot fill the disk.
    owner = f",uid={config['uid']},gid={config['uid']}" if config["uid"] is not None else ""
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={config['limits']['temp_bytes']},mode=700{owner}")
    return "/tmp"


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _drop_capabilities() -> None:
    """No capability now or after any exec (bounding set empty, root's exec rules off and locked)."""
    last = int(_read("/proc/sys/kernel/cap_last_cap"))
    for cap in range(last + 1):
        _prctl(PR_CAPBSET_DROP, cap, "drop the capability bounding set")
    _prctl(PR_SET_SECUREBITS, SECURE_ALL_LOCKED, "lock the securebits")
    none = (_CapData * 2)()
    _check(_libc.capset(ctypes.byref(_CapHeader(0x20080522, 0)), none), "drop capabilities")


def confine_executor(config: dict[str, Any], cwd: str) -> None:
    """rlimits, then no privileges: the worker's own uid (as root) or no capabilities (in a user namespace)."""
    limits = config["limits"]
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"], limits["memory_bytes"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["max_file_bytes"], limits["max_file_bytes"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_seconds_lifetime"], limits["cpu_seconds_lifetime"]))
    if limits["max_processes"] is not None:  # counted per uid, or per user namespace (since Linux 5.14)
        resource.setrlimit(resource.RLIMIT_NPROC, (limits["max_processes"], limits["max_processes"]))
    os.chdir(cwd)  # before the uid changes: the server's temp dir on the way may be closed to that uid
    uid = config["uid"]
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    if config["mode"] == "userns":
        _drop_capabilities()
    _prctl(PR_SET_NO_NEW_PRIVS, 1, "set no_new_privs")
    os.environ.update({"HOME": cwd, "TMPDIR": cwd})


class Programs:
    """User modules, compiled and executed once per executor, by the sha256 of their source."""

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
    try:
        namespace = programs.load(request["source"])
    except BaseException as error:  # user code: every failure is reported, none kills the worker
        return {"ok": False, "kind": "load_failed", "message": _one_line(error), "traceback": user_traceback(error)}
    function = namespace.get(request["function"])
    if not callable(function):
        return {"ok": False, "kind": "load_failed", "traceback": None,
                "message": f"the code defines no function {request['function']!r}"}
    used = _cpu_used()
    resource.setrlimit(resource.RLIMIT_CPU, (int(used + request["cpu_seconds"]) + 1,
                                             resource.getrlimit(resource.RLIMIT_CPU)[1]))
    try:
        value = function(*request["args"], **request["kwargs"])
    except BaseException as error:  # user code, as above (SystemExit and KeyboardInterrupt too)
        return {"ok": False, "kind": "raised", "message": _one_line(error), "traceback": user_traceback(error)}
    try:
        json.dumps(value)
    except (TypeError, ValueError) as error:
        return {"ok": False, "kind": "unserializable", "traceback": None,
                "message": f"{request['function']} returned a {type(value).__name__}, which is not JSON: {error}"}
    return {"ok": True, "value": value}


def _cpu_used() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _one_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".splitlines()
    return text[0] if text else type(error).__name__


def send_frame(fd: int, message: dict[str, Any]) -> None:
    data = json.dumps(message).encode()
    data = FRAME.pack(len(data)) + data
    while data:
        data = data[os.write(fd, data):]


def read_frame(fd: int) -> dict[str, Any] | None:
    """One frame, or None at end of file; ValueError for anything that is not one JSON object."""
    header = _read_exactly(fd, FRAME.size)
    if header is None:
        return None
    (size,) = FRAME.unpack(header)
    if size > MAX_FRAME:
        raise ValueError(f"a frame of {size} bytes")
    body = _read_exactly(fd, size)
    if body is None:
        raise ValueError("a truncated frame")
    message = json.loads(body)
    if not isinstance(message, dict):
        raise ValueError("a frame that is not an object")
    return message


def _read_exactly(fd: int, size: int) -> bytes | None:
    chunks = []
    while size:
        chunk = os.read(fd, min(size, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def executor_main(config: dict[str, Any], cwd: str, requests: int, replies: int) -> None:
    try:
        confine_executor(config, cwd)
    except OSError as error:
        send_frame(replies, {"ok": False, "message": f"the sandbox could not confine itself: {error}"})
        return
    send_frame(replies, {"ok": True})
    programs = Programs()
    while (request := read_frame(requests)) is not None:
        send_frame(replies, handle(request, programs))


class Executor:
    """The supervisor's side of its child that runs user code."""

    def __init__(self, pid: int, requests: int, replies: int) -> None:
        self.pid = pid
        self.requests = requests
        self.replies = replies

    @classmethod
    def start(cls, config: dict[str, Any], cwd: str, closed_in_child: list[int]) -> Executor:
        request_read, request_write = os.pipe()
        reply_read, reply_write = os.pipe()
        pid = os.fork()
        if pid == 0:
            for fd in (*closed_in_child, request_write, reply_read):
                os.close(fd)
            try:
                executor_main(config, cwd, request_read, reply_write)
            finally:
                os._exit(0)
        os.close(request_read)
        os.close(reply_write)
        return cls(pid, request_write, reply_read)

    def ready(self) -> str | None:
        """None once the executor has confined itself, else why it could not."""
        try:
            message = read_frame(self.replies)
        except ValueError as error:
            return str(error)
        if message is None:
            return self.exit_reason()
        return None if message.get("ok") is True else str(message.get("message"))

    def call(self, request: dict[str, Any]) -> dict[str, Any]:
        if select.select([self.replies], [], [], 0)[0]:  # written between calls: not a reply to anything
            return self.broken("wrote outside the protocol between calls")
        try:
            send_frame(self.requests, request)
            reply = read_frame(self.replies)
        except BrokenPipeError:
            reply = None
        except ValueError as error:
            return self.broken(f"broke the protocol: {error}")
        if reply is None:
            return {"ok": False, "kind": "killed", "message": self.exit_reason(), "traceback": None}
        if reply.get("ok") is True and set(reply) == {"ok", "value"}:
            return {"ok": True, "value": reply["value"]}
        if reply.get("ok") is False and reply.get("kind") in FAILURE_KINDS and isinstance(reply.get("message"), str) \
                and isinstance(reply.get("traceback"), str | None):
            return {"ok": False, "kind": reply["kind"], "message": reply["message"], "traceback": reply["traceback"]}
        return self.broken("sent a reply that is not one")

    def broken(self, why: str) -> dict[str, Any]:
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        return {"ok": False, "kind": "killed", "message": f"the user's code {why}", "traceback": None}

    def exit_reason(self) -> str:
        _, status = os.waitpid(self.pid, 0)
        if os.WIFSIGNALED(status):
            name = signal.Signals(os.WTERMSIG(status)).name
            why = {"SIGKILL": "killed (memory, or the process limit)", "SIGXCPU": "CPU time limit exceeded"}.get(
                name, name)
            return f"the worker died: {why}"
        return f"the worker exited with status {os.WEXITSTATUS(status)}"

    def cpu_used(self) -> float:
        fields = _read(f"/proc/{self.pid}/stat").rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _other_processes(executor: int) -> int:
    """Processes in the pid namespace besides the supervisor and the executor (user code forked them)."""
    return sum(1 for name in os.listdir("/proc") if name.isdigit() and int(name) not in {1, executor})


def supervise(config: dict[str, Any], protocol_in: BinaryIO, protocol_out: BinaryIO) -> None:
    def say(message: dict[str, Any]) -> None:
        protocol_out.write(json.dumps(message).encode() + b"\n")
        protocol_out.flush()

    try:
        cwd = confine_supervisor(config)
        _prctl(PR_SET_DUMPABLE, 0, "make the supervisor non-dumpable")
    except OSError as error:
        say({"id": None, "ok": False, "message": f"the sandbox could not confine itself: {error}"})
        return
    executor = Executor.start(config, cwd, [protocol_in.fileno(), protocol_out.fileno()])
    why = executor.ready()
    if why is not None:
        say({"id": None, "ok": False, "message": why})
        return
    say({"id": None, "ok": True, "value": "ready"})
    isolated = config["mode"] != "none"
    for line in protocol_in:
        request = json.loads(line)
        reply = {"id": request["id"]} | executor.call(request)
        if reply["ok"]:
            reply |= {"cpu_used": executor.cpu_used(),
                      "processes": _other_processes(executor.pid) if isolated else 0}
        say(reply)
        if reply.get("kind") == "killed":
            return


def main() -> None:
    config = json.loads(sys.argv[1])
    # The protocol lives on fds that only this process holds; fd 0-2 become /dev/null for everything else.
    protocol_in = os.fdopen(os.dup(0), "rb")
    protocol_out = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)
    supervise(config, protocol_in, protocol_out)


if __name__ == "__main__":
    main()
