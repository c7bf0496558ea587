"""An `--engine-url` on another machine over plain http is said at start: the engine key and the adapter paths
cross the network in the clear. Loopback URLs and https say nothing."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from artlike_server.engine.launch import EngineConfig
from artlike_server.engine.pool_setup import build_engine_pool, travels_in_clear
from artlike_server.settings import ScaleOutSettings


@pytest.mark.parametrize(("url", "clear"), [
    ("http://10.0.0.5:8000", True), ("http://engine.example", True), ("http://127.0.0.1.example:80", True),
    ("https://10.0.0.5:8000", False), ("http://127.0.0.1:8000", False), ("http://127.3.2.1", False),
    ("http://localhost:8000", False), ("http://LOCALHOST.:8000", False), ("http://[::1]:8000", False),
])
def test_which_urls_travel_in_the_clear(url: str, clear: bool) -> None:
    assert travels_in_clear(url) is clear


async def test_build_engine_pool_warns_for_plain_http_to_another_machine(tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    urls = ("http://10.0.0.5:8000", "https://10.0.0.6:8000", "http://127.0.0.1:8001")
    scale_out = ScaleOutSettings(engines=0, engine_urls=urls, engine_keys=("remote-key",))
    base = EngineConfig(model_path=tmp_path, served_model_name="base", port=1, log_path=tmp_path / "engine.log")
    with caplog.at_level(logging.WARNING, logger="artlike_server.engine.pool_setup"):
        pool = build_engine_pool(scale_out, base, api_key=None)
    await pool.stop()  # nothing started: closes the clients
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "http://10.0.0.5:8000" in warnings[0] and "in the clear" in warnings[0]
    assert "remote-key" not in warnings[0]
