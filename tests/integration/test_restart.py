"""Stopping and starting the shared server: one SIGTERM, one start, and what each promises.

- **SIGTERM while it trains** (as a service manager stops it: the proxy alone is signalled): the
  `/_train_model` stream ends with `server_shutting_down`, the proxy, engine, trainer and reward workers all
  exit within a minute, and nothing of the interrupted step is left on disk.
- **A managed job that was running resumes** from its last committed iteration once the server is back.
- **A cancel that waited for a training step is applied at the restart**: cancelled while its step waits
  for the trainer, a job answers `running` with the cancel pending; the SIGTERM comes before the step ends,
  and the restarted server cancels the job instead of resuming it, so its model stays where it was.
- **Tinker checkpoints outlive the server, and its futures never hang a client**: the REST client lists a
  run's checkpoints after the restart, a sampler on the saved weights samples what it sampled before, a new
  run starts from the saved state, and a future of the stopped process is answered as failed.
- **The restarted server serves each model's latest committed step, and nothing on disk bricks a start**:
  a step whose weights were cut short falls back to the step before, a step never committed is removed,
  an unreadable model.json leaves that model out.

A server start is the costliest thing a test can do, so they share this one stop of the
session's server (`disruptive`: after every other test). The scenario runs once, in the module fixture;
each test checks one promise on what it recorded. The resumed job's test runs last: the job trains on in
the server while the others check theirs."""

from __future__ import annotations

import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import orjson
import psutil
import pytest
import tinker
from artlike_server.jobs.service import STOP_WAIT_S
from artlike_server.launcher import ServerProcess
from tinker import types

from tests.integration.test_jobs import finished
from tests.integration.test_training import (
    assert_same_output,
    greedy_probe,
    health,
    latest_step,
    register,
    rollout_groups,
    train_lines,
)

from .helpers import http_client

pytestmark = [pytest.mark.integration, pytest.mark.disruptive]

SURVIVOR = "survivor"  # trained one step before the stop
INTERRUPTED = "interrupted"  # training when the SIGTERM comes
JOB_ITERATIONS = 5  # enough that the job is still running when the SIGTERM comes (it shares the trainer)
JOB_REWARD = "def reward_fn(completion, **kwargs):\n    return len(completion[0]['content']) / 50\n"
T = TypeVar("T")


def job_body(iterations: int) -> dict[str, Any]:
    return {"learningRate": 1e-4, "iterations": iterations, "batchSize": 1, "rewardFunction": JOB_REWARD,
            "trainingData": [{"prompt": "What is AI?"}, {"prompt": "Define ML"}], "groupSize": 2, "maxTokens": 8}


@dataclass
class PendingCancel:
    job_id: str
    target_model: str
    step: int  # the target model's latest step when the cancel came
    answer: dict[str, Any]  # the cancel request's answer


@dataclass
class Restart:
    events: list[dict[str, Any]]  # the interrupted /_train_model stream, a "-- SIGTERM --" marker included
    exit_s: float  # from the SIGTERM to the proxy's exit
    returncode: int
    leftovers: list[str]  # the proxy's descendants still alive after it exited
    job_id: str
    cancelled: PendingCancel  # a second job, cancelled while its step waited for the trainer
    survivor_output: tuple[str, list[float]]  # greedy, before the stop
    base_output: tuple[str, list[float]]
    tinker: TinkerBefore


@dataclass
class TinkerBefore:
    """A Tinker run trained one step and checkpointed before the stop, and what it answered then."""

    run_id: str
    state_path: str
    sampler_path: str
    tokens: list[int]
    greedy: list[int]  # the sampler's greedy tokens
    loss: float  # forward loss of `tokens` on the saved weights
    request_id: str  # a future of the stopped process


def tinker_service(server: ServerProcess) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=server.base_url, api_key=f"tml-{server.api_key}")


def tinker_datum(tokens: list[int]) -> list[types.Datum]:
    return [types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})]


def tinker_checkpoints(server: ServerProcess) -> TinkerBefore:
    training = tinker_service(server).create_lora_training_client(base_model=server.model_id, rank=4).result()
    tokens = [1, 4093, 314, 253, 1345, 30, 2]
    training.forward_backward(tinker_datum(tokens), "cross_entropy")
    training.optim_step(types.AdamParams(learning_rate=5e-3)).result()
    state = training.save_state("kept").result().path
    sampler_path = training.save_weights_for_sampler("kept").result().path
    sampler = tinker_service(server).create_sampling_client(model_path=sampler_path).result()
    greedy = sampler.sample(types.ModelInput.from_ints(tokens[:3]), num_samples=1,
                            sampling_params=types.SamplingParams(max_tokens=4, temperature=0.0)).result()
    # An operation still queued at the stop: it waits for numbers 6..98, which never come.
    optim = httpx.post(f"{server.base_url}/api/v1/optim_step", json={"model_id": training.model_id, "seq_id": 99},
                       headers={"X-API-Key": f"tml-{server.api_key}"}, timeout=30)
    return TinkerBefore(run_id=training.model_id, state_path=state, sampler_path=sampler_path, tokens=tokens,
                        greedy=greedy.sequences[0].tokens, request_id=optim.json()["request_id"],
                        loss=training.forward(tinker_datum(tokens), "cross_entropy").result().metrics["loss:sum"])


def wait_job(http: httpx.Client, job_id: str, predicate: Callable[[dict[str, Any]], bool],
             limit_s: float = 420) -> dict[str, Any]:
    deadline = time.monotonic() + limit_s
    while not predicate(job := http.get(f"/v1/fine_tuning/jobs/{job_id}").json()):
        assert time.monotonic() < deadline, f"job {job_id} never got there: {job}"
        time.sleep(0.5)  # polling another process: nothing to await instead
    return job


def cancel_during_step(server: ServerProcess, job_id: str) -> PendingCancel:
    """Cancel `job_id` once its training step has begun: it waits for the trainer, which INTERRUPTED holds."""
    with http_client(server, timeout=120) as http:
        target = http.get(f"/v1/fine_tuning/jobs/{job_id}").json()["artlike"]["target_model"]
        deadline = time.monotonic() + 120
        while True:
            while target not in health(server)["training"]:
                assert time.monotonic() < deadline, "the job never began a training step"
                time.sleep(0.2)  # polling another process: nothing to await instead
            step = latest_step(server, target)
            # A step that had trained before INTERRUPTED took the trainer may only be committing: it ends
            # within the cancel's wait. One still training, its step not committed, waits for the trainer.
            time.sleep(STOP_WAIT_S + 1)
            if target in health(server)["training"] and latest_step(server, target) == step:
                break
        answer = http.post(f"/v1/fine_tuning/jobs/{job_id}/cancel")
        assert answer.status_code == 200, answer.text
    return PendingCancel(job_id, target, step, answer.json())


def train_until_sigterm(server: ServerProcess, groups: list[dict[str, Any]], before_sigterm: Callable[[], T]
                        ) -> tuple[list[dict[str, Any]], float, T]:
    """A long /_train_model job of INTERRUPTED; at its first step `before_sigterm` runs, then the proxy gets
    SIGTERM. Returns the stream's lines, when the signal was sent and what `before_sigterm` returned."""
    body = {"model": INTERRUPTED, "groups": groups, "config": {"epochs": 30, "learning_rate": 1e-4}}
    events: list[dict[str, Any]] = []
    signalled: float | None = None
    result: T | None = None
    with http_client(server, timeout=600) as http, \
            http.stream("POST", f"{server.base_url}/_train_model", json=body) as response:
        for line in response.iter_lines():
            events.append(orjson.loads(line))
            if events[-1]["type"] == "step" and signalled is None:
                result = before_sigterm()
                signalled = time.monotonic()
                server.process.send_signal(signal.SIGTERM)
                events.append({"type": "-- SIGTERM --"})
    assert signalled is not None and result is not None, events
    return events, signalled, result


def clone_model(data_dir: Path, source: str, name: str) -> Path:
    """A copy of a stored model under another name (its model.json renamed), as a second user's model."""
    target = data_dir / "models" / name
    shutil.copytree(data_dir / "models" / source, target)
    record = orjson.loads((target / "model.json").read_bytes())
    (target / "model.json").write_bytes(orjson.dumps({**record, "name": name}))
    return target


def damage(data_dir: Path) -> None:
    """What disks and kills leave behind, planted while the server is down."""
    corrupt = clone_model(data_dir, SURVIVOR, "corrupt")  # a step whose weights were cut short: a disk fault
    weights = corrupt / "steps" / "1" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    # What a kill -9 between a step's rename and its history line leaves: the step was never committed.
    uncommitted = clone_model(data_dir, SURVIVOR, "uncommitted")
    (uncommitted / "history.jsonl").write_bytes(b"")
    (data_dir / "models" / "garbled").mkdir()  # a model.json that cannot be read
    (data_dir / "models" / "garbled" / "model.json").write_text("{not json")


@pytest.fixture(scope="module")
def restart(server: ServerProcess) -> Restart:
    try:
        return stop_and_start(server)
    finally:
        if server.process.poll() is not None:  # the scenario failed while the server was down: later tests need it
            server.start()


def stop_and_start(server: ServerProcess) -> Restart:
    register(server, SURVIVOR)
    train_lines(server, {"model": SURVIVOR, "groups": rollout_groups(server, SURVIVOR),
                         "config": {"learning_rate": 2e-3, "max_grad_norm": 10.0}})
    survivor_output, base_output = greedy_probe(server, SURVIVOR), greedy_probe(server, server.model_id)
    tinker_before = tinker_checkpoints(server)
    register(server, INTERRUPTED)
    groups = rollout_groups(server, INTERRUPTED)

    with http_client(server, timeout=120) as http:
        started = http.post("/api/training/start", json={"model": server.model_id, **job_body(JOB_ITERATIONS)})
        assert started.status_code == 200, started.text
        job_id = started.json()["job_id"]
        # long enough to be mid-step when cancelled; it trains its own model beside the first job
        to_cancel = http.post("/api/training/start", json={"model": server.model_id, **job_body(100)})
        assert to_cancel.status_code == 200, to_cancel.text
        wait_job(http, job_id, lambda j: j["artlike"]["iteration"] >= 1 or finished(j))

    assert server.process is not None
    descendants = psutil.Process(server.process.pid).children(recursive=True)  # engine, trainer, reward workers
    events, signalled, cancelled = train_until_sigterm(
        server, groups, lambda: cancel_during_step(server, to_cancel.json()["job_id"]))
    returncode = server.process.wait(timeout=120)
    exit_s = time.monotonic() - signalled
    _, alive = psutil.wait_procs(descendants, timeout=10)  # the proxy waited for its engine and trainer already
    leftovers = [f"{p.pid} {p.name()}" for p in alive if p.status() != psutil.STATUS_ZOMBIE]

    damage(Path(server.data_dir))
    server.start()
    return Restart(events=events, exit_s=exit_s, returncode=returncode, leftovers=leftovers, job_id=job_id,
                   cancelled=cancelled, survivor_output=survivor_output, base_output=base_output,
                   tinker=tinker_before)


def test_sigterm_during_training_cancels_the_job_and_stops_promptly(restart: Restart, server: ServerProcess) -> None:
    last = restart.events[-1]
    assert last["type"] == "error", restart.events[-3:]
    assert last["code"] == "server_shutting_down" and last["served_step"] == 0
    assert "shutting down" in last["message"]
    assert restart.exit_s < 60, restart.exit_s
    assert restart.returncode in (0, -signal.SIGTERM), restart.returncode
    assert restart.leftovers == [], "engine, trainer or reward processes outlived the server"
    model_dir = Path(server.data_dir) / "models" / INTERRUPTED
    assert sorted(p.name for p in (model_dir / "steps").iterdir()) == ["0"]  # the old step is still the latest
    assert not (model_dir / "history.jsonl").exists() or not (model_dir / "history.jsonl").read_text().strip()
    staging = model_dir / ".staging"
    assert not staging.exists() or not any(staging.iterdir())  # staging discarded
    assert latest_step(server, INTERRUPTED) == 0


def test_a_cancel_pending_at_the_stop_is_applied_at_restart(restart: Restart, server: ServerProcess) -> None:
    cancelled = restart.cancelled
    # the answer told the truth: the step had not ended, so the job ran on with the cancel pending
    assert cancelled.answer["status"] == "running", cancelled.answer
    assert cancelled.answer["artlike"]["stop_request"] == "cancel"
    with http_client(server, timeout=120) as http:
        # The restarted server takes up its jobs once its trainer is up, after /health says ok: until then
        # the job reads as it was at the stop. Then it is cancelled, or (wrongly) runs another iteration.
        stopped_at = cancelled.answer["artlike"]["iteration"]
        job = wait_job(http, cancelled.job_id, lambda j: finished(j) or j["artlike"]["iteration"] > stopped_at)
        body = http.get(f"/v1/fine_tuning/jobs/{cancelled.job_id}/events", params={"limit": 1000}).json()
    assert job["status"] == "cancelled" and job["artlike"]["stop_request"] is None, job
    messages = [e["message"] for e in body["data"]]
    assert any(m.startswith("cancelled at restart") for m in messages), messages
    assert not any("resumes" in m or "running from iteration" in m for m in messages), messages
    assert latest_step(server, cancelled.target_model) == cancelled.step  # its model did not move


def test_tinker_checkpoints_survive_the_restart_and_old_futures_fail(restart: Restart, server: ServerProcess) -> None:
    before = restart.tinker
    rest = tinker.RestClient(base_url=server.base_url, api_key=f"tml-{server.api_key}")
    listed = rest.list_checkpoints(before.run_id).result().checkpoints
    assert {c.tinker_path for c in listed} == {before.state_path, before.sampler_path}
    service = tinker_service(server)
    sampler = service.create_sampling_client(model_path=before.sampler_path).result()
    greedy = sampler.sample(types.ModelInput.from_ints(before.tokens[:3]), num_samples=1,
                            sampling_params=types.SamplingParams(max_tokens=4, temperature=0.0)).result()
    assert greedy.sequences[0].tokens == before.greedy
    resumed = service.create_training_client_from_state_with_optimizer(before.state_path).result()
    loss = resumed.forward(tinker_datum(before.tokens), "cross_entropy").result().metrics["loss:sum"]
    assert loss == pytest.approx(before.loss, rel=1e-4)
    lost = httpx.post(f"{server.base_url}/api/v1/retrieve_future", json={"request_id": before.request_id},
                      headers={"X-API-Key": f"tml-{server.api_key}"}, timeout=60)
    assert lost.status_code == 200 and lost.json()["category"] == "server" and "restarted" in lost.json()["error"]


def test_the_latest_step_is_served_and_nothing_on_disk_bricks_a_start(restart: Restart, server: ServerProcess) -> None:
    assert health(server)["status"] == "ok"
    assert latest_step(server, SURVIVOR) == 1
    assert_same_output(greedy_probe(server, SURVIVOR), restart.survivor_output)
    assert_same_output(greedy_probe(server, f"{SURVIVOR}@1"), restart.survivor_output)
    models = Path(server.data_dir) / "models"
    for fallback in ("corrupt", "uncommitted"):
        assert latest_step(server, fallback) == 0, fallback
        # step 0 is the untrained adapter: it answers as the base model does
        assert_same_output(greedy_probe(server, fallback), restart.base_output)
    assert not (models / "uncommitted" / "steps" / "1").exists()  # removed: it can never be served
    assert (models / "corrupt" / "steps" / "1").exists()  # committed: kept on disk for the operator, logged
    listed = httpx.get(f"{server.base_url}/v1/trainable_models", headers=server.headers, timeout=30)
    assert "garbled" not in {m["name"] for m in listed.json()["data"]}
    # the next job of the fallen-back model commits past the refused step instead of colliding with it
    lines = train_lines(server, {"model": "corrupt", "groups": rollout_groups(server, "corrupt"),
                                 "config": {"learning_rate": 1e-4}})
    assert lines[-1][1]["type"] == "done" and lines[-1][1]["step"] == 2, lines[-1]
    log = server.log_path.read_text()
    assert "step 1 of 'corrupt' cannot be served" in log and "removing step 1 of 'uncommitted'" in log


# Last: the resumed job runs on in the server from the restart on, while the tests above check their
# promises; this one waits for it to finish.
def test_a_running_job_resumes_from_its_last_committed_iteration(restart: Restart, server: ServerProcess) -> None:
    with http_client(server, timeout=120) as http:
        job = wait_job(http, restart.job_id, finished)
        assert job["status"] == "succeeded", job["error"]
        body = http.get(f"/v1/fine_tuning/jobs/{restart.job_id}/events", params={"limit": 1000}).json()
    events = list(reversed(body["data"]))  # oldest first
    messages = [e["message"] for e in events]
    assert any("the server restarted; the job resumes from iteration" in m for m in messages), messages
    iterations = [e["data"]["iteration"] for e in events if e["type"] == "metrics"]
    assert sorted(set(iterations)) == list(range(1, JOB_ITERATIONS + 1))
