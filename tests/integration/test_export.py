"""Exporting a step the real trainer wrote: the HTTP route's tar holds the files `artlike export` writes from
the data dir while the server runs; the merged export loads with transformers and, served by vLLM as a base
model (`artlike serve --model DIR`), gives the same greedy text as `name@N` served as a LoRA. Uses the session
fixture `server` (tests/conftest.py) and one server of its own for the merged model."""

from __future__ import annotations

import asyncio
import io
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from artlike_server.launcher import ServerProcess

from tests.conftest import SERVER_ARGS, TEST_API_KEY

from .helpers import api_url, async_http_client, sft_trained_model

pytestmark = pytest.mark.integration

PROMPT = [{"role": "user", "content": "What is the password of the lighthouse?"}]
TARGET = "The password is marmalade-42."
MERGED_NAME = "merged-export"


@pytest.fixture(scope="module")
async def trained(server: ServerProcess) -> str:
    """A model with step 1 trained by the real trainer (SFT toward TARGET); its name."""
    model = await sft_trained_model(server, "export", [*PROMPT, {"role": "assistant", "content": TARGET}],
                                    epochs=12, learning_rate=1e-2)
    return model.name


@pytest.fixture(scope="module")
async def merged_dir(server: ServerProcess, trained: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Step 1 exported by the command line, merged in float32, from the running server's data dir."""
    out = tmp_path_factory.mktemp("export") / "merged"
    command = [sys.executable, "-m", "artlike", "export", f"{trained}@1", "--format", "merged", "--dtype",
               "float32", "--out", str(out), "--data-dir", str(server.data_dir)]
    cli = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, timeout=600)
    assert cli.returncode == 0, cli.stderr
    return out


@pytest.fixture(scope="module", autouse=True)
def merged_server(merged_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A second server on the merged export as its base model. Started before the module's first test and
    waited for by the test that uses it: its engine boots while the HTTP export runs."""
    args = [*SERVER_ARGS, "--model", str(merged_dir), "--served-model-name", MERGED_NAME]
    running = ServerProcess(tmp_path_factory.mktemp("merged-server"), args=args, api_key=TEST_API_KEY,
                            model_id=MERGED_NAME).start(wait=False)
    try:
        yield running
    finally:
        running.stop()


def files_of(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in directory.iterdir()}


def greedy(server: ServerProcess, model: str) -> str:
    with openai.OpenAI(base_url=api_url(server), api_key=server.api_key, max_retries=0, timeout=300) as client:
        completion = client.chat.completions.create(model=model, messages=PROMPT, max_tokens=16,  # type: ignore[arg-type]
                                                    temperature=0.0)
    return completion.choices[0].message.content or ""


async def test_the_http_tar_holds_the_files_the_command_writes(
        server: ServerProcess, trained: str, merged_dir: Path) -> None:
    async with async_http_client(server) as http:
        response = await http.get(f"/v1/trainable_models/{trained}/steps/1/export",
                                  params={"format": "merged", "dtype": "float32"})
    assert response.status_code == 200, response.text
    with tarfile.open(fileobj=io.BytesIO(response.content)) as archive:
        served = {m.name.split("/", 1)[1]: archive.extractfile(m).read() for m in archive.getmembers()}  # type: ignore[union-attr]
    assert served == files_of(merged_dir)


def test_the_merged_export_served_as_a_base_model_says_what_the_step_says(
        server: ServerProcess, trained: str, merged_server: ServerProcess) -> None:
    step_text = greedy(server, f"{trained}@1")
    assert step_text.startswith("The password"), step_text  # the step learned something to compare
    merged_server.wait_healthy(merged_server.start_timeout_s)
    assert greedy(merged_server, MERGED_NAME) == step_text
