"""`Services` for tests that run the real app (`app.create_app`) over a few real or fake parts.

`fake_services(models=..., log=...)` fills every part a test does not give with `Absent`, which fails the
test on first use, naming the part; the settings-shaped parts get their defaults.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from artlike_server.metrics import Metrics
from artlike_server.openai_api.policy import RequestPolicy
from artlike_server.settings import EngineSettings, LimitsSettings, NetworkSettings, TrainerSettings
from artlike_server.state import BaseModelInfo, Services
from artlike_server.studio.page_logins import PageLogins


class Absent:
    """A part the test does not use."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attribute: str) -> Any:
        raise AssertionError(f"this test's services have no {self._name!r} (asked for .{attribute})")


def fake_services(**parts: Any) -> Services:
    network = parts.setdefault("network", NetworkSettings())
    defaults: dict[str, Any] = {
        "base_model": BaseModelInfo("base", Path("base"), 64),
        "max_body_bytes": LimitsSettings().max_body_bytes,
        "engine_settings": EngineSettings(dtype="float32"),
        "trainer_settings": TrainerSettings(dtype="float32"),
        "requests": RequestPolicy(),
        "metrics": Metrics(),
        "page_logins": PageLogins(api_key=network.api_key),
        "dialects": {},
    }
    values = {field.name: parts.get(field.name, defaults.get(field.name, Absent(field.name)))
              for field in dataclasses.fields(Services)}
    unknown = set(parts) - set(values)
    if unknown:
        raise TypeError(f"Services has no parts {sorted(unknown)}")
    return Services(**values)
