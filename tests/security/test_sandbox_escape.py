"""User code never runs unisolated by accident: the escape battery (sandbox_battery.py) as the server's user
and, when that is root, again as an ordinary user made for the test. Network, data dir, other processes'
environ (the server's, holding its key), outliving the kill after setsid, fork and memory bombs, writes
outside the private /tmp, forged protocol lines and privileges: each is contained, or user code is refused."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import site
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from artlike_server.launcher import ServerProcess

REPOSITORY = Path(__file__).resolve().parents[2]
BATTERY = Path(__file__).with_name("sandbox_battery.py")
KEY = f"sk-battery-{secrets.token_hex(8)}"


def python_path() -> str:
    return os.pathsep.join([str(REPOSITORY / "server"), str(REPOSITORY / "src"), *site.getsitepackages()])


def assert_contained(report: dict[str, Any]) -> None:
    open_ways = {name: result["detail"] for name, result in report["results"].items() if not result["held"]}
    assert not open_ways, f"isolation {report['mode']}: {open_ways}"
    if report["mode"] == "none":
        assert set(report["results"]) == {"refused", "nothing_written"}
    else:
        assert len(report["results"]) == 13


@pytest.fixture
def owned_dir() -> Iterator[Path]:
    """A directory outside /tmp that only the battery's user may write (user code must not)."""
    path = REPOSITORY / f".sandbox-battery-{secrets.token_hex(4)}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_the_battery_as_the_servers_user(tmp_path: Path, owned_dir: Path) -> None:
    done = subprocess.run([sys.executable, str(BATTERY), str(tmp_path), str(owned_dir)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "ARTLIKE_API_KEY": KEY,
                                                       "PYTHONPATH": python_path()})
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert_contained(report)
    if os.geteuid() == 0:  # root (CI) keeps full isolation, the whole worker bounded where a cgroup is
        assert report["mode"] == "root"


@pytest.fixture
def ordinary_user() -> Iterator[str]:
    if os.geteuid() != 0:
        pytest.skip("already an ordinary user: test_the_battery_as_the_servers_user ran the battery as one")
    if not shutil.which("useradd") or not shutil.which("runuser"):
        pytest.skip("useradd or runuser is missing: no ordinary user to run the battery as")
    name = f"artlike-t{secrets.token_hex(3)}"
    subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", name], check=True, capture_output=True)
    try:
        yield name
    finally:
        subprocess.run(["userdel", "--remove", name], capture_output=True)


@pytest.fixture
def traversable_checkout() -> Iterator[None]:
    """Lets other users pass through (never list) the directories above this checkout and the venv, for the
    test's duration: a clone under a private directory (`mktemp -d` makes them mode 700) would otherwise hide
    the server's code from the ordinary user, and the battery would never run as one."""
    changed: list[tuple[Path, int]] = []
    for leaf in {REPOSITORY, Path(sys.prefix).resolve(), Path(os.path.realpath(sys.executable)).parent}:
        for directory in [leaf, *leaf.parents]:
            mode = directory.stat().st_mode
            if not mode & stat.S_IXOTH:
                directory.chmod(stat.S_IMODE(mode) | stat.S_IXOTH)
                changed.append((directory, stat.S_IMODE(mode)))
    try:
        yield
    finally:
        for directory, mode in reversed(changed):
            directory.chmod(mode)


def readable_python(user: str) -> str | None:
    """A Python of this version the user may run, importing the server from this checkout; None if none."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (sys.executable, os.path.realpath(sys.executable), f"/usr/bin/{version}",
                      f"/usr/local/bin/{version}"):
        check = subprocess.run(["runuser", "-u", user, "--", candidate, "-c",
                                "import artlike_server.jobs.sandbox"], capture_output=True,
                               env={"PATH": os.environ["PATH"], "PYTHONPATH": python_path()}, cwd="/")
        if check.returncode == 0:
            return candidate
    return None


def test_the_battery_as_an_ordinary_user(ordinary_user: str, traversable_checkout: None, owned_dir: Path) -> None:
    python = readable_python(ordinary_user)
    if python is None:
        pytest.skip(f"no Python with this checkout's packages is readable by an ordinary user ({REPOSITORY} "
                    "or the venv's interpreter is private to root)")
    owned_dir.mkdir(mode=0o700)
    shutil.chown(owned_dir, ordinary_user, ordinary_user)
    work = Path(tempfile.mkdtemp(prefix="artlike-battery-"))
    shutil.chown(work, ordinary_user, ordinary_user)
    try:
        done = subprocess.run(["runuser", "-u", ordinary_user, "--", python, str(BATTERY), str(work),
                               str(owned_dir)], capture_output=True, text=True, timeout=120, cwd="/",
                              env={"PATH": os.environ["PATH"], "PYTHONPATH": python_path(), "ARTLIKE_API_KEY": KEY})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["uid"] != 0
    assert_contained(report)


@pytest.mark.integration
def test_the_server_reports_how_it_isolates_user_code(server: ServerProcess) -> None:
    sandbox = httpx.get(f"{server.base_url}/health", headers=server.headers, timeout=10).json()["sandbox"]
    assert sandbox["user_code"] == "isolated", sandbox
    assert sandbox["isolation"] == ("root" if os.geteuid() == 0 else "userns")
    assert "retired after any failure" in sandbox["sharing"]
