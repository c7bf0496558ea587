"""`art.Jobs` request bodies and stream handling against a scripted transport (the real server's side is
tests/integration/test_jobs.py): what `start` uploads and posts, the reward/grader rules, following a job's
log across a dropped connection, and the CLI's exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

import artlike as art
from artlike._jobs_cli import add_parser, run

JOB = {"id": "ftjob-1", "object": "fine_tuning.job", "created_at": 1, "status": "queued", "model": "base"}


class FakeServer:
    def __init__(self) -> None:
        self.requests: list[httpx.Request] = []
        self.follows = 0
        self.final_status = "succeeded"

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        path = request.url.path
        if path == "/v1/files":
            return httpx.Response(200, json={"id": f"file-{len(self.requests)}", "object": "file"})
        if path == "/v1/fine_tuning/jobs" and request.method == "POST":
            return httpx.Response(200, json=JOB)
        if path.startswith("/api/training/logs/"):
            self.follows += 1
            events = [{"object": "fine_tuning.job.event", "id": f"ftevent-{i}", "created_at": 1, "level": "info",
                       "message": f"event {i}", "type": "metrics",
                       "data": {"iteration": i, "total_iterations": 2, "reward_mean": 0.5, "loss": 0.1}}
                      for i in (1, 2)]
            after = request.url.params.get("after")
            if after is None:  # the first connection drops after one event
                return httpx.Response(200, stream=DroppingStream(json.dumps(events[0]).encode() + b"\n"))
            assert after == "ftevent-1"
            body = json.dumps(events[1]) + "\n" + json.dumps(JOB | {"status": self.final_status}) + "\n"
            return httpx.Response(200, content=body.encode())
        if path == "/v1/fine_tuning/jobs/ftjob-1":
            return httpx.Response(200, json=JOB | {"status": self.final_status, "fine_tuned_model": "ft-x"})
        if path.endswith("/cancel"):
            return httpx.Response(409, json={"error": {"message": "job ftjob-1 already succeeded",
                                                       "type": "conflict_error", "param": None,
                                                       "code": "job_finished"}})
        if path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "base"}, {"id": "ft-x"}]})
        return httpx.Response(404, json={"error": {"message": path, "type": "x", "param": None, "code": None}})


class DroppingStream(httpx.AsyncByteStream, httpx.SyncByteStream):
    def __init__(self, first: bytes) -> None:
        self.first = first

    async def __aiter__(self):  # type: ignore[no-untyped-def]
        yield self.first
        raise httpx.ReadError("connection dropped")

    def __iter__(self):  # type: ignore[no-untyped-def]
        yield self.first
        raise httpx.ReadError("connection dropped")


@pytest.fixture
def fake() -> FakeServer:
    return FakeServer()


def jobs_for(fake: FakeServer) -> art.Jobs:
    return art.Jobs("http://server", "key", transport=httpx.MockTransport(fake),
                    retry=art.RetryPolicy(max_retries=0))


async def test_start_uploads_rows_and_posts_a_python_grader(fake: FakeServer, tmp_path: Path) -> None:
    reward = tmp_path / "reward.py"
    reward.write_text("def reward_fn(completion, **kwargs):\n    return 1.0\n")
    job = await jobs_for(fake).start(data=[{"prompt": "hi"}], reward=reward, model="base", iterations=3,
                                     group_size=4, validation_data="file-9", dynamic_sampling=True,
                                     temperature_schedule=art.Schedule(start=1.2, end=1.0, steps=3))
    assert job.id == "ftjob-1"
    upload, create = fake.requests
    assert b'name="purpose"' in upload.content and b'{"prompt":"hi"}\n' in upload.content
    body = json.loads(create.content)
    assert body["training_file"] == "file-1" and body["validation_file"] == "file-9"
    method = body["method"]
    assert method["type"] == "reinforcement"
    assert method["reinforcement"]["grader"] == {"type": "python", "name": "reward", "source": reward.read_text()}
    assert method["reinforcement"]["hyperparameters"] == {
        "iterations": 3, "group_size": 4, "dynamic_sampling": True,
        "temperature_schedule": {"start": 1.2, "end": 1.0, "steps": 3, "shape": "linear", "warmup_steps": 0}}


def test_reward_xor_grader_is_checked_before_anything_is_sent(fake: FakeServer) -> None:
    jobs = jobs_for(fake)
    with pytest.raises(ValueError, match="exactly one"):
        jobs.start_sync(data=[{"prompt": "x"}], model="base")
    with pytest.raises(ValueError, match="exactly one"):
        jobs.start_sync(data=[{"prompt": "x"}], model="base", reward="def reward_fn(c): return 1",
                        grader={"type": "math_accuracy"})
    with pytest.raises(ValueError, match="no reward"):
        jobs.start_sync(data=[{"prompt": "x"}], model="base", method="supervised", reward="x")
    assert fake.requests == []
    job = jobs.start_sync(data="file-3", model="base", grader={"type": "math_accuracy"}, method="reinforcement")
    assert job.status == "queued"
    assert json.loads(fake.requests[0].content)["method"]["reinforcement"]["grader"] == {"type": "math_accuracy"}


async def test_follow_resumes_after_a_dropped_connection_and_stops_at_the_job(fake: FakeServer) -> None:
    events = [e async for e in jobs_for(fake).follow("ftjob-1")]
    assert [e.id for e in events] == ["ftevent-1", "ftevent-2"] and fake.follows == 2
    fake.follows = 0
    sync_events = list(jobs_for(fake).follow_sync("ftjob-1"))
    assert [e.id for e in sync_events] == ["ftevent-1", "ftevent-2"]
    final = await jobs_for(fake).wait("ftjob-1")
    assert final.done and final.fine_tuned_model == "ft-x"


def cli(fake: FakeServer, *args: str) -> tuple[int, str]:
    import argparse
    import io

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    out = io.StringIO()
    return run(parser.parse_args(["jobs", *args]), out, jobs=jobs_for(fake)), out.getvalue()


def test_cli_exit_codes(fake: FakeServer, tmp_path: Path,
                        capsys: pytest.CaptureFixture[str]) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "hi"}\n')
    code, out = cli(fake, "start", "--data", str(rows), "--grader", json.dumps({"type": "math_accuracy"}),
                    "--iterations", "2", "--dynamic-sampling", "--entropy-coef", "0.003", "--guide-field", "answer",
                    "--clip-cov-fraction", "0.02", "--positive-advantage-weight", "0.1", "-H", 'temperature_schedule={"start": 1.2, "end": 1.0, "steps": 50}',
                    "--entropy-target", "0.2", "-f")
    assert code == 0 and "started ftjob-1" in out and "iteration 2: reward 0.500" in out
    created = json.loads(next(r for r in fake.requests if r.url.path == "/v1/fine_tuning/jobs").content)
    assert created["model"] == "base"  # asked /v1/models for the base model
    assert created["method"]["reinforcement"]["hyperparameters"] == {
        "iterations": 2, "entropy_coef": 0.003, "clip_cov_fraction": 0.02, "positive_advantage_weight": 0.1,
        "dynamic_sampling": True,
        "guide_field": "answer", "entropy_control": {"target": 0.2},
        "temperature_schedule": {"start": 1.2, "end": 1.0, "steps": 50}}
    fake.final_status = "failed"
    code, _ = cli(fake, "logs", "-f", "ftjob-1")
    assert code == 1
    code, _ = cli(fake, "cancel", "ftjob-1")
    assert code == 2 and "409 job_finished: job ftjob-1 already succeeded" in capsys.readouterr().err


def test_the_cli_finds_the_server_in_artlike_server_first(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from artlike._jobs_cli import default_server

    assert default_server({}) == "http://127.0.0.1:8000"
    assert default_server({"ARTLIKE_BASE_URL": "http://b:1"}) == "http://b:1"
    assert default_server({"ARTLIKE_SERVER": "http://s:2", "ARTLIKE_BASE_URL": "http://b:1"}) == "http://s:2"
    monkeypatch.setenv("ARTLIKE_SERVER", "http://s:2")
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["jobs", "list"]).base_url == "http://s:2"
