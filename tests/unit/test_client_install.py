"""`pip install artlike` (the client) in a fresh venv brings no torch, vLLM or server stack, and works.

Installs the repository itself, so its declared dependencies (pyproject `dependencies`) are what is
tested. Needs PyPI (the pip cache makes reruns quick)."""

from __future__ import annotations

import os
import subprocess
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SMOKE = """
import importlib.util, json, sys
import artlike as art

for heavy in ("torch", "vllm", "fastapi", "transformers", "uvicorn"):
    assert importlib.util.find_spec(heavy) is None, heavy + " was installed with the client"

model = art.TrainableModel("agent", "base/model", "http://127.0.0.1:9")
with model.trajectory() as t:
    client = t.openai_client()
    assert str(client.base_url) == t.base_url + "/"
event = art.parse_event('{"type": "status", "stage": "training"}')
assert isinstance(event, art.StatusEvent)
try:
    model.get_step_sync()
except art.APIConnectionError:
    pass
else:
    raise AssertionError("nothing listens on port 9")
print(json.dumps({"version": art.__version__, "server_loaded": "artlike_server" in sys.modules}))
"""


def run(*command: str | Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    environment = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([str(part) for part in command], capture_output=True, text=True, check=check,
                          env=environment, timeout=600)


def test_the_client_installs_and_works_without_the_server_stack(tmp_path: Path) -> None:
    environment = tmp_path / "client-venv"
    venv.create(environment, with_pip=True)
    python, artlike_script = environment / "bin" / "python", environment / "bin" / "artlike"
    run(python, "-m", "pip", "install", "-q", "--disable-pip-version-check", REPO)

    smoke = run(python, "-c", SMOKE)
    assert smoke.stdout.strip().endswith('"server_loaded": false}'), smoke.stdout + smoke.stderr

    assert run(artlike_script, "--version").stdout.strip().startswith("artlike ")
    serve = run(artlike_script, "serve", check=False)
    assert serve.returncode == 2
    assert "pip install 'artlike[server]'" in serve.stderr

