"""How `make test` shares the suite between two pytest-xdist workers (`-n 2 --dist loadgroup`).

A worker gets whole groups: every test of one session server together (so one worker boots it, and its
`disruptive` tests still run after its others), and every other module whole (its module-scoped fixtures,
engines among them, are built once). The groups come from the tests' fixtures, which only the workers see
(the controller that schedules never collects), so each worker writes the group of every test id to a file
the controller named before starting them, and `ServerGroupScheduling` reads it when it first splits the
collection. (xdist's own `xdist_group` marks cannot carry the groups: they work by rewriting each item's
node id, which pytest 9 no longer reads.)
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from xdist.scheduler import LoadScopeScheduling

GROUPS_ENV = "ARTLIKE_TEST_GROUPS_FILE"


def in_parallel_run(config: pytest.Config) -> bool:
    """True in the workers and the controller of `--dist loadgroup`."""
    return bool(getattr(config.option, "loadgroup", False)) or getattr(config.option, "dist", "no") == "loadgroup"


def name_the_groups_file(config: pytest.Config) -> None:
    """In the controller, before the workers start (they inherit its environment)."""
    if hasattr(config, "workerinput") or getattr(config.option, "dist", "no") != "loadgroup":
        return
    descriptor, path = tempfile.mkstemp(prefix="artlike-test-groups-", suffix=".json")
    os.close(descriptor)
    os.environ[GROUPS_ENV] = path
    config.add_cleanup(lambda: Path(path).unlink(missing_ok=True))


def write_groups(items: list[pytest.Item], group_of: Callable[[pytest.Item], str]) -> None:
    """In a worker, after sorting its collection: every test id and its group (both workers write the same)."""
    target = Path(os.environ[GROUPS_ENV])
    partial = target.with_name(f"{target.name}.{os.getpid()}")
    partial.write_text(json.dumps({item.nodeid: group_of(item) for item in items}))
    partial.replace(target)


class ServerGroupScheduling(LoadScopeScheduling):  # type: ignore[misc]  # xdist ships no types
    """xdist's scheduling of whole scopes, a scope being a group from the workers' file."""

    def __init__(self, config: pytest.Config, log: Any = None) -> None:
        super().__init__(config, log)
        self._groups: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self._groups is None:  # first called once every worker has collected
            self._groups = json.loads(Path(os.environ[GROUPS_ENV]).read_text())
        return self._groups.get(nodeid, nodeid.split("::", 1)[0])
