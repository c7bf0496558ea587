"""Where user code cannot be isolated (no `unshare` here: a PATH without it), it is refused with a 503
`sandbox_unavailable` naming what is missing and the opt-in, at job creation, at graders/run and at call
time; with --unsafe-user-code it runs, the start logs a warning, and /health and the studio page (in headless
chromium) say so. The refusal runs on the real Sandbox, GraderService and JobService in-process; the opt-in
on a real `artlike serve`, stopped once /health and the page answered (it never waits for the engine)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from artlike_server.app import create_app
from artlike_server.jobs.graders_service import GraderService
from artlike_server.jobs.intake import check_grade_source
from artlike_server.jobs.rewards import python_grader_runner
from artlike_server.jobs.runner import ServerAccess
from artlike_server.jobs.sandbox import Sandbox, SandboxLimits, SandboxUnavailable
from artlike_server.jobs.service import JobService, NewJob
from artlike_server.jobs.spec import JobSpec
from artlike_server.jobs.store import JobStore

from tests.conftest import SERVER_ARGS, TEST_API_KEY
from tests.unit.fake_services import fake_services

GRADER = {"type": "python", "name": "p", "source": "def grade(sample, item):\n    return 0.25\n"}
LIMITS = SandboxLimits(call_timeout_s=5, workers=1)


@pytest.fixture
def path_without_unshare(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """PATH as it is, less util-linux `unshare` (every other program linked into one directory)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for directory in os.environ["PATH"].split(os.pathsep):
        if os.path.isdir(directory):
            for name in os.listdir(directory):
                if name != "unshare" and not (bin_dir / name).exists():
                    (bin_dir / name).symlink_to(Path(directory) / name)
    monkeypatch.setenv("PATH", str(bin_dir))
    return str(bin_dir)


async def graders_app(sandbox: Sandbox) -> httpx.AsyncClient:
    app = create_app(fake_services(graders=GraderService(
        python_grader_runner(sandbox), None, check_source=check_grade_source, require_sandbox=sandbox.require)))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost")


@pytest.fixture
async def refusing(tmp_path: Path, path_without_unshare: str) -> AsyncIterator[Sandbox]:
    box = Sandbox(tmp_path / "sandbox", limits=LIMITS)
    yield box
    await box.close()


async def test_user_code_is_refused_at_call_time_naming_what_is_missing(refusing: Sandbox, tmp_path: Path) -> None:
    marker = tmp_path / "ran.txt"
    assert refusing.isolation.mode == "none" and "unshare" in (refusing.isolation.missing or "")
    with pytest.raises(SandboxUnavailable) as refused:
        await refusing.call(f"def f():\n    open('{marker}', 'w').write('x')\n", "f")
    assert (refused.value.status_code, refused.value.code) == (503, "sandbox_unavailable")
    assert "unshare" in refused.value.message and "--unsafe-user-code" in refused.value.message
    assert not marker.exists()
    assert refusing.enforcement()["user_code"].startswith("refused")


async def test_graders_run_answers_503_in_the_openai_shape(refusing: Sandbox) -> None:
    async with await graders_app(refusing) as http:
        answer = await http.post("/v1/fine_tuning/alpha/graders/run",
                                 json={"grader": GRADER, "model_sample": "x"})
        assert answer.status_code == 503
        error = answer.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "sandbox_unavailable"
        assert "--unsafe-user-code" in error["message"]
        # A grader without user code still runs.
        checked = await http.post("/v1/fine_tuning/alpha/graders/run", json={"model_sample": "a", "grader": {
            "type": "string_check", "name": "s", "input": "{{sample.output_text}}", "reference": "a",
            "operation": "eq"}})
        assert checked.status_code == 200, checked.text


async def test_a_job_with_user_code_is_refused_when_created(refusing: Sandbox, tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs")
    jobs = JobService(store, refusing, ServerAccess("http://127.0.0.1:9", None), judge=None)
    spec = JobSpec.model_validate({
        "api": "openai", "method": "reinforcement", "base_model": "base", "target_model": "t",
        "create_target": False, "iterations": 1, "train_rows": 1,
        "reward": {"kind": "python", "source": "def reward_fn(c, **k):\n    return 1\n", "entry": "reward_fn"}})
    try:
        with pytest.raises(SandboxUnavailable):
            jobs.create(NewJob(spec=spec, train_rows=[{"prompt": "p"}], validation_rows=[]))
        assert store.unfinished() == []  # nothing stored, nothing queued
    finally:
        await jobs.shutdown()
        store.close()


async def test_the_opt_in_runs_user_code_unisolated(tmp_path: Path, path_without_unshare: str) -> None:
    box = Sandbox(tmp_path / "sandbox", limits=LIMITS, allow_unsafe=True)
    try:
        async with await graders_app(box) as http:
            answer = await http.post("/v1/fine_tuning/alpha/graders/run", json={"grader": GRADER, "model_sample": "x"})
        assert answer.status_code == 200 and answer.json()["reward"] == 0.25, answer.text
        assert box.enforcement()["user_code"].startswith("UNSAFE")
    finally:
        await box.close()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def unsafe_server(tmp_path: Path, path_without_unshare: str) -> Iterator[tuple[str, Path]]:
    """`artlike serve --unsafe-user-code` where unshare is missing, until its /health answers with details."""
    port, log = free_port(), tmp_path / "serve.log"
    command = [sys.executable, "-m", "artlike_server.cli", "serve", "--port", str(port), "--data-dir",
               str(tmp_path / "data"), *SERVER_ARGS, "--unsafe-user-code"]
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, "ARTLIKE_API_KEY": TEST_API_KEY})
    try:
        yield f"http://127.0.0.1:{port}", log
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.mark.integration
def test_an_unsafe_server_says_so_in_health_and_its_log(unsafe_server: tuple[str, Path]) -> None:
    url, log = unsafe_server
    headers = {"Authorization": f"Bearer {TEST_API_KEY}"}
    deadline, body = time.monotonic() + 90, {}
    while time.monotonic() < deadline and "sandbox" not in body:
        try:
            body = httpx.get(f"{url}/health", headers=headers, timeout=5).json()
        except httpx.TransportError:
            time.sleep(0.5)  # not listening yet: another process's start, nothing to await
    assert body["sandbox"]["isolation"] == "none", body
    assert body["sandbox"]["user_code"].startswith("UNSAFE"), body["sandbox"]
    assert "user code runs UNISOLATED" in log.read_text()
    graded = httpx.post(f"{url}/v1/fine_tuning/alpha/graders/run", headers=headers, timeout=30,
                        json={"grader": GRADER, "model_sample": "x"})
    assert graded.status_code == 200 and graded.json()["reward"] == 0.25, graded.text
    banner = studio_banner(url)
    if banner is None:
        pytest.skip("the studio's banner was not checked: no system `chromium` or no `playwright` (make setup "
                    "installs both); /health and the log were")
    assert banner.startswith("Unsafe: this server runs user code"), banner


def studio_banner(url: str) -> str | None:
    """The studio page's sandbox banner text, logged in with the key, in headless chromium (None: no browser)."""
    executable = shutil.which("chromium") or shutil.which("chromium-browser")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return None
    if executable is None:
        return None
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"], headless=True)
        try:
            page = browser.new_page()
            page.set_default_timeout(30_000)
            page.goto(f"{url}/ui")
            page.wait_for_selector("#login:not([hidden])")
            page.fill("#login-key", TEST_API_KEY)
            page.click("#login-submit")
            page.wait_for_selector("#sandbox-banner:not([hidden])")
            return str(page.inner_text("#sandbox-banner"))
        finally:
            browser.close()
