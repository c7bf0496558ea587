"""`python -m artlike` is the `artlike` console script (it needs `artlike.__main__`)."""

from __future__ import annotations

import subprocess
import sys

from artlike._version import __version__


def test_python_dash_m_artlike_runs_the_cli() -> None:
    version = subprocess.run([sys.executable, "-m", "artlike", "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout.strip() == f"artlike {__version__}"
    serve_help = subprocess.run([sys.executable, "-m", "artlike", "serve", "--help"], capture_output=True,
                                text=True)
    assert serve_help.returncode == 0 and "--data-dir" in serve_help.stdout, serve_help.stderr
