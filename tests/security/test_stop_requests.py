"""Stop requests survive restarts: a cancel or pause that was waiting for the end of a training step when the
server stopped is applied at the next start, so a cancelled job never runs again (nor moves its model).

On the real `JobStore` in a tmp dir, left as a stopped server leaves it, and the real `JobService.start()`.
The whole path (cancel during a step, SIGTERM, restart) runs in tests/integration/test_restart.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from artlike_server.errors import Conflict
from artlike_server.jobs import motterl, openai_jobs
from artlike_server.jobs.runner import ServerAccess
from artlike_server.jobs.sandbox import Sandbox
from artlike_server.jobs.service import JobService
from artlike_server.jobs.spec import JobSpec
from artlike_server.jobs.store import JobStore

UNREACHABLE = ServerAccess("http://127.0.0.1:9", None)  # no job may run here: nothing answers on it


def spec(target: str) -> JobSpec:
    return JobSpec.model_validate({
        "api": "openai", "method": "reinforcement", "base_model": "base", "target_model": target,
        "create_target": False, "iterations": 5, "train_rows": 1,
        "reward": {"kind": "python", "source": "def reward_fn(c, **k):\n    return 1\n", "entry": "reward_fn"}})


def left_running(store: JobStore, job_id: str, stop_request: str | None) -> None:
    """A job as a server stopped mid-step leaves it: `running`, two iterations done, maybe a stop request."""
    store.create(job_id, spec(f"model-of-{job_id}"), training_file=None, validation_file=None, suffix=None,
                 metadata=None, train_rows=[{"prompt": "p"}], validation_rows=[])
    store.update(job_id, status="running", iteration=2, stop_request=stop_request)


@pytest.fixture
async def service(tmp_path: Path) -> AsyncIterator[JobService]:
    store = JobStore(tmp_path / "jobs")
    left_running(store, "ftjob-cancelled", "cancel")
    left_running(store, "ftjob-paused", "pause")
    left_running(store, "ftjob-resumed", None)
    sandbox = Sandbox(tmp_path / "sandbox")
    jobs = JobService(store, sandbox, UNREACHABLE, judge=None)
    yield jobs
    await jobs.shutdown()  # the requeued job's runner is cancelled before it takes a step
    await sandbox.close()
    store.close()


def messages(jobs: JobService, job_id: str) -> list[str]:
    return [e.message for e in jobs.store.events(job_id)]


async def test_a_stored_cancel_is_applied_at_start_instead_of_resuming(service: JobService) -> None:
    service.start()
    job = service.get("ftjob-cancelled")
    assert (job.status, job.stop_request, job.iteration) == ("cancelled", None, 2)
    assert job.finished_at is not None
    assert "ftjob-cancelled" not in service.running_jobs()
    assert any("cancel requested before the server stopped was applied" in m for m in messages(service, job.id))
    assert not any("resumes" in m for m in messages(service, job.id))
    assert openai_jobs.job_object(job)["status"] == "cancelled"


async def test_a_stored_pause_is_applied_at_start_and_the_job_can_resume(service: JobService) -> None:
    service.start()
    job = service.get("ftjob-paused")
    assert (job.status, job.stop_request) == ("paused", None)
    assert "ftjob-paused" not in service.running_jobs()
    assert any("pause requested before the server stopped was applied" in m and "from iteration 2" in m
               for m in messages(service, job.id))
    assert service.resume(job.id).status == "queued"  # a pause, not an end


async def test_a_running_job_without_a_stop_request_still_resumes(service: JobService) -> None:
    service.start()
    assert service.get("ftjob-resumed").status == "queued"
    assert service.running_jobs() == ["ftjob-resumed"]
    assert any("resumes from iteration 2" in m for m in messages(service, "ftjob-resumed"))


async def test_a_pending_stop_is_in_the_answer_and_a_cancel_is_not_turned_into_a_pause(
        service: JobService) -> None:
    pending = service.get("ftjob-cancelled")  # before the restart: the step has not ended yet
    wire: dict[str, Any] = openai_jobs.job_object(pending)
    assert wire["status"] == "running" and wire["artlike"]["stop_request"] == "cancel"
    assert motterl.status_object(pending)["stopRequest"] == "cancel"
    with pytest.raises(Conflict) as refused:
        await service.pause(pending.id)
    assert refused.value.code == "job_cancelling"
    assert service.get(pending.id).stop_request == "cancel"
