"""The server process stays light: torch is the trainer worker's, never the proxy's (memory, start-up time and
a smaller heap for the garbage collector on the request path)."""

from __future__ import annotations

import subprocess
import sys


def test_the_server_app_does_not_import_torch() -> None:
    check = "import sys, artlike_server.app, artlike_server.cli; print(sorted({'torch', 'transformers', 'peft'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr
