"""The studio's API on the real server: ratings, continual training from them (K, replay, no signal, the
promotion guard), rollback, the trajectory browser, the experiment trackers' records (TensorBoard, W&B,
MLflow) and the page's session rules.
The page itself in a real browser: test_studio_browser.py. Uses the session fixture `server`."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from uuid import uuid4

import httpx
import pytest
from artlike_server.launcher import ServerProcess
from artlike_server.trackers.base import step_scalars
from artlike_server.trackers.mlflow_runs import metric_name

from tests.tracker_records import mlflow_run, read_until, wandb_run

pytestmark = pytest.mark.integration

WAIT_S = 120.0


def register(http: httpx.Client, server: ServerProcess, prefix: str) -> str:
    name = f"{prefix}-{uuid4().hex[:6]}"
    response = http.post("/v1/trainable_models", json={"name": name, "base_model": server.model_id})
    assert response.status_code == 201, response.text
    return name


def sample(http: httpx.Client, model: str, prompt: str, n: int, *, in_order: bool = False,
           **extra: Any) -> list[dict[str, Any]]:
    """n answers to one prompt, each its own trajectory; returns their views (completion id, text). They are
    asked for at once (the engine batches them) unless `in_order`: then one after the other, recorded in
    the order of the list."""
    def one(_: int) -> dict[str, Any]:
        trajectory = f"studio-test-{uuid4().hex[:10]}"
        response = http.post(f"/t/{trajectory}/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 8,
            "temperature": 1.0, **extra})
        assert response.status_code == 200, response.text
        view = http.get(f"/v1/trajectories/{trajectory}/view").json()
        assert view["completions"][0]["response"]["content"] == response.json()["choices"][0]["message"]["content"]
        return dict(view) | {"completion_id": view["completions"][0]["id"]}

    if in_order or n == 1:
        return [one(index) for index in range(n)]
    with ThreadPoolExecutor(max_workers=n) as pool:
        return list(pool.map(one, range(n)))


def rate(http: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    response = http.post("/v1/ratings", json=body)
    assert response.status_code == 201, response.text
    data: list[dict[str, Any]] = response.json()["data"]
    return data


def wait_for_run(http: httpx.Client, model: str, after: dict[str, Any] | None = None) -> dict[str, Any]:
    """The continual status once a run newer than `after` (an earlier status) has finished and none is going."""
    deadline = time.monotonic() + WAIT_S
    previous = after["last_run"]["started_at"] if after and after["last_run"] else 0.0
    while time.monotonic() < deadline:
        status = http.get(f"/v1/trainable_models/{model}/continual").json()
        run = status["last_run"]
        if run and run["started_at"] > previous and run["finished_at"] and status["state"] in ("waiting", "off"):
            return dict(status)
        time.sleep(0.2)
    raise AssertionError(f"no continual run finished in {WAIT_S} s: {status}")


def test_ratings_are_taken_listed_exported_paired_and_leave_the_inbox(http: httpx.Client, server: ServerProcess) -> None:
    model = register(http, server, "rate")
    answers = sample(http, model, "Name a colour.", 4, metadata={"source": "rating-test"})
    ids = [a["completion_id"] for a in answers]
    up = rate(http, {"kind": "thumb", "completion_id": ids[0], "value": "up", "comment": "<b>nice</b>"})[0]
    assert (up["reward"], up["model"], up["step"], up["rater"], up["split"]) == (1.0, model, 0, "api", "train")
    assert rate(http, {"kind": "scale", "completion_id": ids[1], "value": 4})[0]["reward"] == 0.75
    ranking = rate(http, {"kind": "ranking", "completion_ids": [ids[2], ids[0], ids[1]], "rater": "bob"})
    assert [r["reward"] for r in ranking] == [1.0, 0.5, 0.0] and len({r["ranking_id"] for r in ranking}) == 1
    assert rate(http, {"kind": "skip", "completion_id": ids[3]})[0]["reward"] is None
    # A rater's second rating of a completion replaces the first.
    again = rate(http, {"kind": "thumb", "completion_id": ids[0], "value": "down"})[0]
    listed = http.get("/v1/ratings", params={"model": model}).json()["data"]
    assert len(listed) == 6 and again["id"] == listed[-1]["id"] and up["id"] not in {r["id"] for r in listed}

    page = http.get("/v1/ratings", params={"model": model, "limit": 2}).json()
    assert len(page["data"]) == 2 and page["has_more"] is True
    rest = http.get("/v1/ratings", params={"model": model, "after": page["last_id"]}).json()
    assert len(rest["data"]) == 4 and rest["has_more"] is False
    assert [r["rater"] for r in http.get("/v1/ratings", params={"model": model, "rater": "bob"}).json()["data"]] \
        == ["bob"] * 3
    lines = http.get("/v1/ratings", params={"model": model, "format": "jsonl"}).text.splitlines()
    exported = [httpx.Response(200, content=line).json() for line in lines]
    by_completion = {a["completion_id"]: a for a in answers}
    for row in exported:
        assert row["prompt"] == [{"role": "user", "content": "Name a colour."}]
        assert row["response"] == by_completion[row["completion_id"]]["completions"][0]["response"]["content"]

    pairs = http.get("/v1/ratings/pairs", params={"model": model}).json()["data"]
    assert pairs and all(p["margin"] > 0 and p["prompt"][0]["content"] == "Name a colour." for p in pairs)
    assert (pairs[0]["chosen_completion_id"], pairs[0]["rejected_completion_id"]) in {(ids[2], ids[1]),
                                                                                      (ids[2], ids[0])}

    fresh = sample(http, model, "Name a fruit.", 2, in_order=True, metadata={"source": "inbox-test"})
    inbox = http.get("/v1/ratings/inbox", params={"model": model}).json()["data"]
    assert [i["completion_id"] for i in inbox] == [a["completion_id"] for a in reversed(fresh)]  # rated ones gone
    assert inbox[0]["messages"] == [{"role": "user", "content": "Name a fruit."}]
    assert inbox[0]["metadata"] == {"source": "inbox-test"}
    assert http.get("/v1/ratings/inbox", params={"model": model, "metadata": "source=rating-test"}).json()["data"] \
        == []

    # DPO from these ratings: pairs of exactly the rated completions (chosen/rejected_completion_id).
    status = http.patch(f"/v1/trainable_models/{model}/continual",
                        json={"enabled": True, "every": 3, "objective": "dpo", "replay": 0}).json()
    assert status["pending_ratings"] == 5  # the skip carries no reward
    status = wait_for_run(http, model)
    assert status["last_run"]["step"] == 1 and status["last_run"]["promoted"] is True, status["last_run"]
    line = http.get(f"/v1/trainable_models/{model}/history").json()["data"][-1]
    assert line["config"]["objective"] == "dpo" and line["annotations"]["ratings"] == 5
    assert next(e for e in status["last_run"]["events"] if e["type"] == "step")["objective"] == "dpo"

    for body, param in (({"kind": "thumb", "completion_id": 10**9, "value": "up"}, "completion_id"),
                        ({"kind": "scale", "completion_id": ids[0], "value": 6}, "value"),
                        ({"kind": "ranking", "completion_ids": [ids[0], ids[0]]}, None),
                        ({"kind": "stars", "completion_id": ids[0]}, None)):
        response = http.post("/v1/ratings", json=body)
        assert response.status_code in (400, 404), response.text
        error = response.json()["error"]
        assert error["message"] and (param is None or param in (error["param"] or ""))


def test_continual_training_every_k_with_replay_no_signal_and_rollback(http: httpx.Client, server: ServerProcess) -> None:
    model = register(http, server, "continual")
    status = http.patch(f"/v1/trainable_models/{model}/continual",
                        json={"enabled": True, "every": 4, "learning_rate": 1e-4}).json()
    assert status["state"] == "waiting" and status["policy"]["every"] == 4 and status["live_step"] == 0
    first = sample(http, model, "Say something kind.", 4)
    for index, answer in enumerate(first):
        rate(http, {"kind": "thumb", "completion_id": answer["completion_id"], "value": "up" if index < 2 else "down"})
    status = wait_for_run(http, model)
    run = status["last_run"]
    assert (run["step"], run["promoted"], run["ratings"], run["replayed"]) == (1, True, 4, 0), run
    assert status["live_step"] == 1 and status["trained_ratings"] == 4 and status["pending_ratings"] == 0
    assert next(e["type"] for e in run["events"]) == "start" and run["events"][-1]["type"] == "done"
    assert "step 1 live, trained on 4 ratings" in status["message"]
    rated = http.get("/v1/ratings", params={"model": model}).json()["data"]
    assert {r["trained_in_step"] for r in rated} == {1}

    # Four new ratings that all agree carry no signal: no step, and the page is told why.
    second = sample(http, model, "Say something funny.", 4)
    for answer in second:
        rate(http, {"kind": "thumb", "completion_id": answer["completion_id"], "value": "up"})
    status = wait_for_run(http, model, after=status)
    assert status["live_step"] == 1 and status["last_run"]["step"] is None
    assert "nothing to learn yet" in status["last_run"]["reason"] and status["pending_ratings"] == 4

    # Four more that differ: a step on the 8 waiting ratings, with the first prompt's answers replayed.
    third = sample(http, model, "Say something wise.", 4)
    for index, answer in enumerate(third):
        rate(http, {"kind": "scale", "completion_id": answer["completion_id"], "value": 5 if index % 2 else 1})
    status = wait_for_run(http, model, after=status)
    run = status["last_run"]
    assert (run["step"], run["ratings"], run["replayed"]) == (2, 8, 4), run
    history = http.get(f"/v1/trainable_models/{model}/history").json()["data"]
    assert history[-1]["annotations"] == {"source": "ratings", "ratings": 8, "replayed": 4}

    # Rewards of trained trajectories reach the browser: filter by reward, view the tokens.
    good = http.get("/v1/trajectories", params={"model": model, "min_reward": 0.9}).json()["data"]
    # (the second prompt's answers, all equal, formed no group: they were never trained with a reward)
    assert {t["trajectory_id"] for t in good} == {a["trajectory_id"] for a in [*first[:2], third[1], third[3]]}
    view = http.get(f"/v1/trajectories/{first[0]['trajectory_id']}/view").json()
    recorded = http.get(f"/v1/trajectories/{first[0]['trajectory_id']}").json()["completions"][0]
    tokens = view["completions"][0]["tokens"]
    assert len(tokens) == len(recorded["output_token_ids"])
    assert [t["logprob"] for t in tokens] == recorded["logprobs"] and view["reward"] == 1.0

    # Rollback: the alias serves step 0 again (new requests are served by it), then moves back.
    info = http.post(f"/v1/trainable_models/{model}/alias", json={"step": 0, "reason": "too chatty"}).json()
    assert (info["latest_step"], info["newest_step"]) == (0, 2)
    served = sample(http, model, "Hello?", 1)[0]["completions"][0]
    assert served["served_model"] == f"{model}@0"
    assert http.get(f"/v1/trainable_models/{model}/continual").json()["live_step"] == 0
    assert http.post(f"/v1/trainable_models/{model}/alias", json={"step": 2}).json()["latest_step"] == 2
    assert sample(http, model, "Hello?", 1)[0]["completions"][0]["served_model"] == f"{model}@2"
    moves = [e for e in http.get(f"/v1/trainable_models/{model}/history").json()["data"] if e.get("event") == "alias"]
    assert [(m["alias_step"], m["previous_step"], m["reason"]) for m in moves] == [(0, 2, "too chatty"),
                                                                                  (2, 0, "set by API")]
    for body, status_code in (({"step": 7}, 404), ({"step": -1}, 400)):
        response = http.post(f"/v1/trainable_models/{model}/alias", json=body)
        assert response.status_code == status_code and response.json()["error"]["param"] == "step"

    # TensorBoard: one point per trained step, the same reward as the history line.
    rewards = tensorboard_scalars(Path(server.data_dir) / "tensorboard" / model, "reward")
    steps = [e for e in history if isinstance(e.get("step"), int)]
    assert rewards == pytest.approx({e["step"]: e["reward"]["mean"] for e in steps}, abs=1e-6)

    # W&B (offline) and MLflow (a file store): every step's values equal its history line, and the alias moves.
    expected = {e["step"]: dict(step_scalars(e)) for e in steps}
    wandb = read_until(lambda: wandb_run(Path(server.data_dir), model),
                       lambda run: run["summary"].get("alias/reason") == "set by API")
    logged = {step: {key: row[key] for key in values} for step, values in expected.items()
              for row in wandb["history"] if row.get("step") == step and values.keys() <= row.keys()}
    assert logged.keys() == expected.keys()
    for step, values in expected.items():
        assert logged[step] == pytest.approx(values), step
    assert [row["alias/step"] for row in wandb["history"] if "alias/step" in row][-2:] == [0, 2]
    uri = (Path(server.data_dir) / "mlruns").as_uri()
    mlflow = read_until(lambda: mlflow_run(uri, model), lambda run: run["tags"].get("alias.step") == "2")
    logged = {step: {key: mlflow["metrics"][metric_name(key)][step] for key in values}
              for step, values in expected.items()}
    for step, values in expected.items():
        assert logged[step] == pytest.approx(values), step
    assert mlflow["tags"]["alias.reason"] == "set by API" and mlflow["metrics"]["alias/step"][0] == 0


def test_the_guard_holds_back_a_step_that_disagrees_with_held_out_ratings(http: httpx.Client, server: ServerProcess) -> None:
    model = register(http, server, "guarded")
    http.patch(f"/v1/trainable_models/{model}/continual", json={
        "enabled": True, "every": 4, "learning_rate": 2e-4, "epochs": 2, "guard": {"enabled": True, "margin": 0.0}})
    answers = sample(http, model, "Describe the sea.", 4)
    ids = [a["completion_id"] for a in answers]
    # Held-out raters disagree with the training raters: what training pushes up, they rated down.
    for index, completion_id in enumerate(ids):
        rate(http, {"kind": "thumb", "completion_id": completion_id, "value": "down" if index < 2 else "up",
                    "rater": "held-out", "split": "holdout"})
    for index, completion_id in enumerate(ids):  # explicit: "auto" holds out a share of prompts
        rate(http, {"kind": "thumb", "completion_id": completion_id, "value": "up" if index < 2 else "down",
                    "split": "train"})
    status = wait_for_run(http, model)
    run = status["last_run"]
    assert run["step"] == 1 and run["promoted"] is False, run
    assert run["guard"]["answers"] == 4 and run["guard"]["shift"] < 0
    assert status["live_step"] == 0 and "not promoted" in run["reason"]
    info = http.get(f"/v1/trainable_models/{model}").json()
    assert (info["latest_step"], info["newest_step"]) == (0, 1)
    assert [s["promoted"] for s in info["steps"]] == [True, False]
    assert sample(http, model, "Hi", 1)[0]["completions"][0]["served_model"] == f"{model}@0"
    assert sample(http, f"{model}@1", "Hi", 1)[0]["completions"][0]["served_model"] == f"{model}@1"
    guard_lines = [e for e in http.get(f"/v1/trainable_models/{model}/history").json()["data"]
                   if e.get("event") == "guard"]
    assert guard_lines and guard_lines[0]["candidate_step"] == 1 and guard_lines[0]["promoted"] is False
    # A person may promote it anyway.
    assert http.post(f"/v1/trainable_models/{model}/alias", json={"step": 1}).json()["latest_step"] == 1


def test_the_page_session_stands_in_for_the_key_with_csrf_on_writes(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.base_url, timeout=30) as browser:
        page = browser.get("/ui")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assert browser.get("/ui/static/app.js").status_code == 200
        assert browser.get("/ui/static/..%2Fui_router.py").status_code == 404
        assert browser.get("/ui/session").json() == {"auth_required": True, "authenticated": False,
                                                     "csrf_token": None}
        assert browser.get("/v1/ratings").status_code == 401
        wrong = browser.post("/ui/session", json={"api_key": "nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        login = browser.post("/ui/session", json={"api_key": server.api_key})
        assert login.status_code == 200
        cookie = login.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie
        csrf = login.json()["csrf_token"]
        assert browser.get("/v1/ratings").status_code == 200  # the cookie authenticates reads
        body = {"kind": "thumb", "completion_id": 10**9, "value": "up"}
        refused = browser.post("/v1/ratings", json=body)
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "csrf_failed"
        assert browser.post("/v1/ratings", json=body, headers={"X-CSRF-Token": "forged"}).status_code == 403
        # With the token the request reaches the route (and fails there: no such completion).
        assert browser.post("/v1/ratings", json=body, headers={"X-CSRF-Token": csrf}).status_code == 404
        other_site = browser.post("/v1/ratings", json=body, headers={"X-CSRF-Token": csrf,
                                                                     "Origin": "http://evil.example"})
        assert other_site.status_code == 403 and other_site.json()["error"]["code"] == "cross_origin"
        assert browser.get("/ui/session").json()["authenticated"] is True
        assert browser.request("DELETE", "/ui/session", headers={"X-CSRF-Token": csrf}).status_code == 204
        assert browser.get("/v1/ratings").status_code == 401


def tensorboard_scalars(run_dir: Path, tag: str) -> dict[int, float]:
    """{step: value} of one scalar tag in a TensorBoard run directory, read with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir))
    accumulator.Reload()
    return {event.step: event.value for event in accumulator.Scalars(tag)}
