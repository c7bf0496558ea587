"""What the host lends the sandbox as root: uids nobody else uses, and a cgroup that bounds a whole worker.

Both are found, never assumed: the uid range is checked against /etc/passwd, /etc/group, /etc/subuid,
/etc/subgid and the running processes; the cgroup parent is the server's own cgroup (v2 with the memory and
pids controllers delegated, else v1 memory + pids), used only once a child could be made there.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

UID_SLOTS = 64  # uids per server: one per live worker
UID_FLOOR = 1_000_000_000  # far above login users and the usual subordinate ranges
UID_CEILING = 2_000_000_000


def used_ids() -> tuple[set[int], list[range]]:
    """Every uid and gid named by the account files or held by a running process, and the subordinate ranges."""
    ids: set[int] = set()
    for table in ("/etc/passwd", "/etc/group"):
        with contextlib.suppress(FileNotFoundError):
            for line in Path(table).read_text().splitlines():
                fields = line.split(":")
                if len(fields) > 2 and fields[2].isdigit():
                    ids.add(int(fields[2]))
    ranges: list[range] = []
    for table in ("/etc/subuid", "/etc/subgid"):
        with contextlib.suppress(FileNotFoundError):
            for line in Path(table).read_text().splitlines():
                fields = line.split(":")
                if len(fields) == 3 and fields[1].isdigit() and fields[2].isdigit():
                    ranges.append(range(int(fields[1]), int(fields[1]) + int(fields[2])))
    for pid in (name for name in os.listdir("/proc") if name.isdigit()):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith(("Uid:", "Gid:")):
                    ids.update(int(value) for value in line.split()[1:])
    return ids, ranges


def free_uid_range(seed: int) -> range:
    """UID_SLOTS consecutive ids, unused as uids and gids, starting near a place `seed` (the pid) picks."""
    ids, ranges = used_ids()
    blocks = (UID_CEILING - UID_FLOOR) // UID_SLOTS
    for step in range(blocks):
        start = UID_FLOOR + ((seed + step) % blocks) * UID_SLOTS
        candidate = range(start, start + UID_SLOTS)
        if not any(i in ids for i in candidate) and not any(
                r.start < candidate.stop and candidate.start < r.stop for r in ranges):
            return candidate
    raise RuntimeError("no free range of sandbox uids")


@dataclass(frozen=True)
class CgroupParent:
    """Where worker cgroups are made: one directory (v2) or the memory and pids hierarchies (v1)."""

    version: int
    dirs: tuple[Path, ...]

    def describe(self) -> str:
        return f"cgroup v{self.version} ({', '.join(str(d) for d in self.dirs)})"


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, file system type, super options) of every mount."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        before, after = line.split(" - ", 1)
        fstype, _, options = after.split()[:3]
        found.append((before.split()[4], fstype, set(options.split(","))))
    return found


def _own_cgroups() -> dict[str, str]:
    """controller (or '' for v2) -> this process's cgroup path."""
    own = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            own[controller] = path
    return own


def _usable(directory: Path) -> bool:
    probe = directory / f"artlike-probe-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError:
        return False
    return True


def find_cgroup_parent() -> CgroupParent | None:
    """The server's own cgroup, where a child bounding memory and processes can be made; None if none can."""
    try:
        mounts, own = _mounts(), _own_cgroups()
    except OSError:
        return None
    for point, fstype, _ in mounts:
        if fstype == "cgroup2" and "" in own:
            directory = Path(point + own[""])
            with contextlib.suppress(OSError):
                enabled = set((directory / "cgroup.subtree_control").read_text().split())
                if {"memory", "pids"} <= enabled and _usable(directory):
                    return CgroupParent(2, (directory,))
    v1 = []
    for controller in ("memory", "pids"):
        found = next((p for p, fstype, options in mounts if fstype == "cgroup" and controller in options), None)
        if found is None or controller not in own:
            return None
        directory = Path(found + own[controller])
        if not _usable(directory):
            return None
        v1.append(directory)
    return CgroupParent(1, tuple(v1))


class WorkerCgroup:
    """One worker's cgroup: its memory (all its processes together) and process count are bounded."""

    def __init__(self, parent: CgroupParent, name: str, memory_bytes: int, max_processes: int) -> None:
        self.version = parent.version
        self.dirs = [directory / name for directory in parent.dirs]
        for directory in self.dirs:
            directory.mkdir()
        if self.version == 2:
            self._write("memory.max", memory_bytes)
            self._write("memory.swap.max", 0, optional=True)
            self._write("pids.max", max_processes)
        else:
            self._write("memory.limit_in_bytes", memory_bytes)
            self._write("memory.memsw.limit_in_bytes", memory_bytes, optional=True)
            self._write("pids.max", max_processes)

    @property
    def procs_files(self) -> list[str]:
        return [str(directory / "cgroup.procs") for directory in self.dirs]

    def _write(self, name: str, value: int, *, optional: bool = False) -> None:
        targets = [directory / name for directory in self.dirs if (directory / name).exists()]
        if not targets and not optional:
            raise OSError(errno.ENOENT, f"no {name} in {', '.join(map(str, self.dirs))}")
        for target in targets:
            target.write_text(str(value))

    def kill_and_remove(self) -> None:
        """Kill whatever is left in it (a process that left its session too), then remove it."""
        for _ in range(100):
            pids = [int(p) for d in self.dirs if d.exists() for p in (d / "cgroup.procs").read_text().split()]
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            try:
                for directory in self.dirs:
                    if directory.exists():
                        directory.rmdir()
                return
            except OSError:
                time.sleep(0.01)
        log.warning("the sandbox cgroup %s could not be removed", self.dirs)
