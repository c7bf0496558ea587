"""Client error paths against an in-process mock server (httpx.MockTransport): status → exception mapping,
retries with backoff, and the NDJSON train stream. Happy paths run against the real server in
tests/integration/test_client.py."""

from __future__ import annotations

import asyncio
import threading
import warnings
from collections.abc import AsyncIterator, Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import orjson
import pytest
from pydantic import ValidationError

import artlike as art
from artlike.types import STREAM_VERSION, ModelInfo

SERVER = "http://artlike.test"
Handler = Callable[[httpx.Request], httpx.Response]


class Sleeps:
    """Records the delays the retry policy asks for, instead of waiting."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def sleep(self, seconds: float) -> None:
        self.delays.append(seconds)

    def sync_sleep(self, seconds: float) -> None:
        self.delays.append(seconds)


def make_model(handler: Handler, *, sleeps: Sleeps | None = None, max_retries: int = 3,
               api_key: str | None = None) -> art.TrainableModel:
    sleeps = sleeps or Sleeps()
    policy = art.RetryPolicy(max_retries=max_retries, sleep=sleeps.sleep, sync_sleep=sleeps.sync_sleep)
    return art.TrainableModel("agent", "base/model", SERVER, api_key=api_key, retry=policy,
                              transport=httpx.MockTransport(handler))


def model_info(step: int = 0) -> dict[str, object]:
    return ModelInfo(name="agent", base_model="base/model", lora=art.LoraConfig(), latest_step=step,
                     served_name=f"agent@{step}", created_at=1.0).model_dump(mode="json")


def openai_error(status: int, message: str, *, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None) -> httpx.Response:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return httpx.Response(status, json=body, headers=headers)


def scored_group(rewards: tuple[float, ...] = (1.0, 0.0)) -> art.TrajectoryGroup:
    model = art.TrainableModel("agent", "base/model", SERVER)
    trajectories = []
    for reward in rewards:
        trajectory = model.trajectory()
        trajectory.reward = reward
        trajectories.append(trajectory)
    return art.TrajectoryGroup(trajectories)


# ------------------------------------------------------------------------------ status → exception


@pytest.mark.parametrize(
    ("status", "error_class"),
    [
        (400, art.BadRequestError),
        (401, art.AuthenticationError),
        (404, art.NotFoundError),
        (409, art.ConflictError),
        (413, art.PayloadTooLargeError),
        (500, art.InternalServerError),
        (501, art.InternalServerError),
        (418, art.APIError),
    ],
)
async def test_error_statuses_map_to_typed_exceptions_with_the_servers_fields(status: int, error_class: type) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return openai_error(status, "model 'agent' has no step 7", code="unknown_step", param="step")

    with pytest.raises(error_class) as raised:
        await make_model(handler).get_step()
    error = raised.value
    assert type(error) is error_class
    assert (error.status_code, error.message, error.type, error.code, error.param) == (
        status, "model 'agent' has no step 7", "invalid_request_error", "unknown_step", "step")
    assert "model 'agent' has no step 7" in str(error)


def test_sync_twin_maps_errors_the_same_way() -> None:
    model = make_model(lambda request: openai_error(409, "registered with another config", type_="conflict_error"))
    with pytest.raises(art.ConflictError, match="registered with another config"):
        model.register_sync()


async def test_a_body_that_is_not_the_openai_shape_becomes_the_message() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, text="<html>no such route</html>")

    with pytest.raises(art.NotFoundError) as raised:
        await make_model(handler).list_steps()
    assert raised.value.message == "<html>no such route</html>"
    assert raised.value.type is None


async def test_the_mapping_uses_the_status_code_not_the_message() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return openai_error(409, "not found", type_="not_found_error")

    with pytest.raises(art.ConflictError):
        await make_model(handler).get_step()


# --------------------------------------------------------------------------------------- retries


async def test_503_is_retried_after_the_servers_retry_after() -> None:
    answers = iter([
        openai_error(503, "engine restarting", type_="service_unavailable_error", headers={"Retry-After": "2"}),
        openai_error(503, "engine restarting", type_="service_unavailable_error", headers={"Retry-After": "1"}),
        httpx.Response(200, json=model_info(step=3)),
    ])
    sleeps = Sleeps()
    model = make_model(lambda request: next(answers), sleeps=sleeps)
    assert await model.get_step() == 3
    assert sleeps.delays == [2.0, 1.0]


def test_sync_retries_use_the_sync_sleep() -> None:
    answers = iter([openai_error(503, "restarting", headers={"Retry-After": "3"}), httpx.Response(200, json=model_info(1))])
    sleeps = Sleeps()
    assert make_model(lambda request: next(answers), sleeps=sleeps).get_step_sync() == 1
    assert sleeps.delays == [3.0]


async def test_without_retry_after_the_backoff_grows_exponentially_with_bounded_jitter() -> None:
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        return httpx.Response(502, text="bad gateway")

    sleeps = Sleeps()
    with pytest.raises(art.InternalServerError) as raised:
        await make_model(handler, sleeps=sleeps, max_retries=3).get_step()
    assert raised.value.status_code == 502
    assert calls == 4  # the first try and 3 retries
    policy = art.RetryPolicy()
    for attempt, delay in enumerate(sleeps.delays):
        nominal = policy.initial_backoff * 2**attempt
        assert nominal * (1 - policy.jitter) <= delay <= nominal


async def test_retries_give_up_with_the_last_error_and_its_retry_after() -> None:
    sleeps = Sleeps()
    handler = lambda request: openai_error(503, "engine down", headers={"Retry-After": "5"})  # noqa: E731
    with pytest.raises(art.ServiceUnavailableError) as raised:
        await make_model(handler, sleeps=sleeps, max_retries=2).get_step()
    assert raised.value.retry_after == 5.0
    assert sleeps.delays == [5.0, 5.0]


@pytest.mark.parametrize("status", [400, 404, 409, 500])
async def test_non_transient_statuses_are_not_retried(status: int) -> None:
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        return openai_error(status, "no")

    with pytest.raises(art.APIError):
        await make_model(handler).get_step()
    assert calls == 1


async def test_connection_failures_are_retried_then_raised_as_api_connection_error() -> None:
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        raise httpx.ConnectError("connection refused", request=request)

    sleeps = Sleeps()
    with pytest.raises(art.APIConnectionError, match="connection refused"):
        await make_model(handler, sleeps=sleeps, max_retries=2).register()
    assert calls == 3
    assert len(sleeps.delays) == 2


async def test_a_read_error_on_a_train_request_is_not_retried() -> None:
    # The train request may have reached the server: sending it again could train twice.
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        raise httpx.ReadError("connection reset", request=request)

    with pytest.raises(art.APIConnectionError):
        await make_model(handler).train([scored_group()], progress=False)
    assert calls == 1


async def test_the_api_key_is_sent_as_a_bearer_token() -> None:
    seen: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        return httpx.Response(200, json=model_info())

    await make_model(handler, api_key="sk-test").get_step()
    make_model(handler, api_key="").get_step_sync()
    assert seen == ["Bearer sk-test", None]


# --------------------------------------------------------------------------------- NDJSON stream


def ndjson(*events: dict[str, object]) -> bytes:
    return b"".join(orjson.dumps(event) + b"\n" for event in events)


START = {"type": "start", "version": STREAM_VERSION, "model": "agent", "from_step": 3, "num_gradient_steps": 2,
         "trajectories": 4, "groups": 2, "groups_skipped": 1, "sequences": 4, "trainable_tokens": 96,
         "reward_mean": 0.5, "reward_std": 0.5}
STATUS = {"type": "status", "stage": "training", "message": "4 sequences", "elapsed_seconds": 0.1}


def step_line(n: int) -> dict[str, object]:
    return {"type": "step", "gradient_step": n, "num_gradient_steps": 2, "loss": 0.1 * n, "policy_loss": 0.1 * n,
            "kl": 0.0, "entropy": 1.5, "grad_norm": 0.4, "clip_fraction": 0.0, "learning_rate": 1e-5,
            "tokens": 48, "seconds": 0.5, "logprob_mismatch": 0.001}


DONE = {"type": "done", "model": "agent@4", "step": 4, "adapter_path": "/data/agent/steps/4",
        "train_seconds": 1.0, "swap_seconds": 0.02}


class TrainServer:
    """A mock `/_train_model` that answers with the given NDJSON body and keeps the request bodies."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.requests: list[dict[str, object]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        assert (request.method, request.url.path) == ("POST", "/_train_model")
        self.requests.append(orjson.loads(request.content))
        return httpx.Response(200, content=self.body, headers={"Content-Type": "application/x-ndjson"})


async def test_awaiting_train_returns_the_result_built_from_typed_events() -> None:
    server = TrainServer(ndjson(START, STATUS, step_line(1), step_line(2), DONE))
    result = await make_model(server).train([scored_group()], progress=False, learning_rate=2e-5)
    assert (result.step, result.model, result.trained) == (4, "agent@4", True)
    assert [event.gradient_step for event in result.metrics] == [1, 2]
    assert result.metrics[1].loss == pytest.approx(0.2)
    assert result.start is not None and result.start.groups_skipped == 1
    assert result.done.adapter_path == "/data/agent/steps/4"
    [sent] = server.requests
    assert sent["model"] == "agent"
    assert sent["config"]["learning_rate"] == 2e-5  # type: ignore[index]


async def test_iterating_train_yields_each_event_typed_in_order() -> None:
    server = TrainServer(ndjson(START, STATUS, step_line(1), step_line(2), DONE))
    events = [event async for event in make_model(server).train([scored_group()])]
    assert [type(event) for event in events] == [art.StartEvent, art.StatusEvent, art.StepEvent, art.StepEvent,
                                                 art.DoneEvent]


def test_train_sync_returns_the_result_and_shows_every_event() -> None:
    server = TrainServer(ndjson(START, step_line(1), step_line(2), DONE))
    seen: list[str] = []
    result = make_model(server).train_sync([scored_group()], progress=False, on_event=lambda e: seen.append(e.type))
    assert result.step == 4
    assert seen == ["start", "step", "step", "done"]


async def test_an_error_line_raises_training_error_with_the_servers_message() -> None:
    error = {"type": "error", "code": "trainer_crashed", "message": "trainer exited with signal 9 (out of memory?)",
             "served_step": 3}
    server = TrainServer(ndjson(START, step_line(1), error))
    seen: list[str] = []
    with pytest.raises(art.TrainingError) as raised:
        async for event in make_model(server).train([scored_group()]):
            seen.append(event.type)
    assert seen == ["start", "step"]  # what came before the error was delivered
    assert (raised.value.code, raised.value.message, raised.value.served_step) == (
        "trainer_crashed", "trainer exited with signal 9 (out of memory?)", 3)
    assert "step 3 is still served" in str(raised.value)


async def test_a_stream_that_ends_without_done_raises() -> None:
    server = TrainServer(ndjson(START, step_line(1)))
    with pytest.raises(art.TrainingError) as raised:
        await make_model(server).train([scored_group()], progress=False)
    assert raised.value.code == "stream_incomplete"


def test_a_stream_that_ends_without_done_raises_in_sync_code_too() -> None:
    with pytest.raises(art.TrainingError, match="without a 'done' line"):
        make_model(TrainServer(ndjson(START))).train_sync([scored_group()], progress=False)


async def test_unknown_event_types_are_yielded_and_otherwise_ignored() -> None:
    # Forward compatibility: a newer server may add event types; an older client must keep working.
    future_event = {"type": "eval", "accuracy": 0.75}
    server = TrainServer(ndjson(START, future_event, step_line(1), step_line(2), DONE))
    events = [event async for event in make_model(server).train([scored_group()])]
    [unknown] = [event for event in events if isinstance(event, art.UnknownEvent)]
    assert unknown.type == "eval"
    assert unknown.model_extra == {"accuracy": 0.75}
    result = await make_model(TrainServer(server.body)).train([scored_group()], progress=False)
    assert result.step == 4 and len(result.metrics) == 2


async def test_new_fields_on_known_events_are_accepted() -> None:
    server = TrainServer(ndjson(START | {"version": STREAM_VERSION + 1, "new_field": 1}, DONE | {"extra": "x"}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = await make_model(server).train([scored_group()], progress=False)
    assert result.step == 4
    assert any("upgrade artlike" in str(warning.message) for warning in caught)


@pytest.mark.parametrize("bad_line", [b"not json\n", b"[1, 2]\n", b'{"type": "step", "loss": "high"}\n'])
async def test_a_malformed_line_raises_invalid_stream(bad_line: bytes) -> None:
    server = TrainServer(ndjson(START) + bad_line + ndjson(DONE))
    with pytest.raises(art.TrainingError) as raised:
        await make_model(server).train([scored_group()], progress=False)
    assert raised.value.code == "invalid_stream"


async def test_blank_lines_are_ignored() -> None:
    server = TrainServer(b"\n" + ndjson(START) + b"\n\n" + ndjson(DONE))
    assert (await make_model(server).train([scored_group()], progress=False)).step == 4


async def test_a_conflict_before_the_stream_raises_conflict_error() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return openai_error(409, "model 'agent' is already training", type_="conflict_error", code="job_running")

    with pytest.raises(art.ConflictError, match="already training"):
        await make_model(handler).train([scored_group()], progress=False)


class _StallingStream(httpx.AsyncByteStream, httpx.SyncByteStream):
    """A response body that sends one line, then times out like a server that went silent."""

    def __init__(self, request: httpx.Request) -> None:
        self.request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield ndjson(START)
        raise httpx.ReadTimeout("timed out", request=self.request)

    def __iter__(self) -> Iterator[bytes]:
        yield ndjson(START)
        raise httpx.ReadTimeout("timed out", request=self.request)


async def test_a_silent_stream_raises_a_timeout_that_names_the_idle_limit() -> None:
    model = make_model(lambda request: httpx.Response(200, stream=_StallingStream(request)))
    with pytest.raises(art.APITimeoutError, match="no line for 7 s"):
        await model.train([scored_group()], progress=False, idle_timeout=7)
    with pytest.raises(art.APITimeoutError, match="no line for 7 s"):
        model.train_sync([scored_group()], progress=False, idle_timeout=7)


# ------------------------------------------------------------------------- client-side validation


def refuse(request: httpx.Request) -> httpx.Response:
    raise AssertionError(f"no request should be sent, got {request.method} {request.url}")


@pytest.mark.parametrize("options", [{"learning_rate": -1.0}, {"epochs": 0}, {"loss_aggregation": "mean"},
                                     {"learning_rte": 1e-5}])
def test_bad_train_options_fail_before_any_request(options: dict[str, object]) -> None:
    model = make_model(refuse)
    with pytest.raises(ValidationError):
        model.train([scored_group()], **options)
    with pytest.raises(ValidationError):
        model.train_sync([scored_group()], **options)


def test_config_and_options_together_are_refused() -> None:
    with pytest.raises(TypeError, match="not both"):
        make_model(refuse).train([scored_group()], config=art.GRPOConfig(), learning_rate=1e-5)


def test_an_unscored_trajectory_fails_before_any_request() -> None:
    group = scored_group()
    group.trajectories[1].reward = None
    with pytest.raises(ValueError, match="has no reward"):
        make_model(refuse).train([group])


def test_a_group_with_unawaited_rollouts_fails_before_any_request() -> None:
    async def rollout() -> art.Trajectory:
        raise AssertionError("never run")

    coroutine = rollout()
    with pytest.raises(ValueError, match="gather_trajectory_groups"):
        make_model(refuse).train([art.TrajectoryGroup([coroutine])])
    coroutine.close()


def test_invalid_model_names_fail_at_construction() -> None:
    for name in ("agent@3", "a/b", "", "-leading-dash"):
        with pytest.raises(ValidationError):
            art.TrainableModel(name, "base/model", SERVER)


def test_delete_steps_must_keep_one() -> None:
    with pytest.raises(ValueError, match="keep must be >= 1"):
        make_model(refuse).delete_steps_sync(keep=0)


async def test_failed_trajectories_are_left_out_of_the_train_request() -> None:
    group = scored_group((1.0, 0.5, 0.0))
    async with group.trajectories[1]:
        raise RuntimeError("the agent crashed")
    server = TrainServer(ndjson(START, DONE))
    model = make_model(server)
    await model.train([group], progress=False)
    sent_ids = [item["trajectory_id"] for item in server.requests[0]["groups"][0]["trajectories"]]  # type: ignore[index]
    assert sent_ids == [group.trajectories[0].id, group.trajectories[2].id]


def test_a_train_stream_is_consumed_once_and_warns_when_never_consumed() -> None:
    model = make_model(TrainServer(ndjson(START, DONE)))
    stream = model.train([scored_group()], progress=False)
    stream.__aiter__()
    with pytest.raises(RuntimeError, match="consumed once"):
        stream.__aiter__()
    with pytest.warns(RuntimeWarning, match="never awaited or iterated"):
        model.train([scored_group()])  # dropped at once: CPython finalizes it here


def test_retry_policy_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        art.RetryPolicy(max_retries=-1)
    with pytest.raises(ValueError):
        art.RetryPolicy(jitter=1.5)
    assert art.RetryPolicy(max_retry_after=10).delay(0, retry_after=120) == 10


# ----------------------------------------------------------------------------- event loops


class _ModelInfoHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, so the pooled connection outlives the first loop

    def do_GET(self) -> None:
        body = orjson.dumps(model_info(step=2))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_one_model_serves_scripts_that_call_asyncio_run_more_than_once() -> None:
    # httpx's async connections belong to the loop that opened them; a second asyncio.run must not reuse them.
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ModelInfoHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        model = art.TrainableModel("agent", "base/model", f"http://127.0.0.1:{server.server_address[1]}", api_key="")
        assert asyncio.run(model.get_step()) == 2
        assert asyncio.run(model.get_step()) == 2
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _no_signal_server(requests: list[str]) -> Handler:
    def handler(request: httpx.Request) -> httpx.Response:
        requests.append(f"{request.method} {request.url.path}")
        if request.url.path == "/_train_model":
            return openai_error(400, "all 1 group(s) have equal rewards within the group, so every advantage is 0",
                                code="no_signal", param="groups")
        return httpx.Response(200, json=model_info(step=3))
    return handler


async def test_a_batch_without_signal_is_a_skipped_step_not_a_crash() -> None:
    requests: list[str] = []
    model = make_model(_no_signal_server(requests))
    with pytest.warns(art.NoSignalWarning, match="nothing trained, step 3 stays served: all 1 group"):
        result = await model.train([scored_group((1.0, 1.0))], progress=False)
    assert (result.trained, result.step, result.model, result.metrics) == (False, 3, "agent@3", [])
    assert result.done.reason is not None and "equal rewards" in result.done.reason
    assert requests == ["POST /_train_model", "GET /v1/trainable_models/agent"]
    with pytest.warns(art.NoSignalWarning):
        events = [event async for event in model.train([scored_group((1.0, 1.0))])]
    assert [e.type for e in events] == ["done"] and not events[0].trained  # type: ignore[union-attr]
    with pytest.raises(art.BadRequestError) as raised:  # strict: the server's 400 as it is
        await model.train([scored_group((1.0, 1.0))], progress=False, strict=True)
    assert raised.value.code == "no_signal"


def test_a_batch_without_signal_is_skipped_in_sync_code_too() -> None:
    requests: list[str] = []
    model = make_model(_no_signal_server(requests))
    with pytest.warns(art.NoSignalWarning):
        result = model.train_sync([scored_group((0.0, 0.0))], progress=False)
    assert (result.trained, result.step) == (False, 3)
    with pytest.raises(art.BadRequestError):
        model.train_sync([scored_group((0.0, 0.0))], progress=False, strict=True)
