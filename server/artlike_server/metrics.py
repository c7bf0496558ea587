"""Prometheus metrics of one server, in its own registry (several apps can live in one test process).

Label values are bounded on purpose: routes are path templates (`/t/{trajectory_id}/v1/chat/completions`,
never the trajectory id itself) and endpoints are the two OpenAI endpoint names. Model steps are not a
label: `name@N` grows without bound over a training run.

    GET /metrics                                    Prometheus text format (`router` below)

Who calls what:
    RequestMetricsMiddleware   request_finished(route, method, status, seconds), in-flight gauge
    openai_api.serving         tokens(...), time_to_first_token(...), completions_recorded(...),
                               completion_log_failed(...)
    model manager              adapter_swapped(seconds)
    training job               training_step(tokens, seconds)
    app startup                track_engine(engine) (or set_engine_restarts(n) on each start),
                               track_engines(pool.describe) (per engine: serving, outstanding, requests),
                               track_completion_log(log)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# Proxy latency is dominated by generation (seconds), but the proxy's own overhead shows in the low buckets.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_SWAP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_STEP_BUCKETS = (0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class _Engine(Protocol):
    @property
    def restarts(self) -> int: ...

    @property
    def state(self) -> str: ...


class _EngineCollector(Collector):
    """Per-engine series, read from the pool at scrape time (`describe()`: one dict per engine). The engine
    label is the pool's id ("local-0", "remote-1"): as many values as engines, fixed at start-up."""

    def __init__(self, describe: Callable[[], Sequence[dict[str, Any]]]) -> None:
        self._describe = describe

    def collect(self) -> Iterator[Metric]:
        engines = self._describe()
        serving = GaugeMetricFamily("artlike_engine_serving", "1 while the engine is in the rotation.",
                                    labels=["engine"])
        outstanding = GaugeMetricFamily("artlike_engine_outstanding_requests",
                                        "Requests sent to the engine and not yet answered.", labels=["engine"])
        requests = CounterMetricFamily("artlike_engine_requests", "Requests routed to the engine.",
                                       labels=["engine"])
        failures = CounterMetricFamily("artlike_engine_failures",
                                       "Requests the engine could not complete (then sent to another).",
                                       labels=["engine"])
        for engine in engines:
            label = [str(engine["id"])]
            serving.add_metric(label, 1.0 if engine["serving"] else 0.0)
            outstanding.add_metric(label, float(engine["outstanding"]))
            requests.add_metric(label, float(engine["requests"]))
            failures.add_metric(label, float(engine["failures"]))
        yield from (serving, outstanding, requests, failures)


class _Log(Protocol):
    @property
    def pending(self) -> int: ...


class _Passes(Protocol):
    passes: int
    fused: int


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "artlike_requests",
            "HTTP requests by route template, method and status.",
            ["route", "method", "status"],
            registry=r,
        )
        self.request_seconds = Histogram(
            "artlike_request_duration_seconds",
            "Request latency until the last response byte.",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge("artlike_requests_in_flight", "Requests being served.", registry=r)
        self.prompt_tokens = Counter(
            "artlike_prompt_tokens", "Prompt tokens of completions served.", ["endpoint"], registry=r
        )
        self.completion_tokens = Counter(
            "artlike_completion_tokens", "Tokens generated.", ["endpoint"], registry=r
        )
        self.ttft_seconds = Histogram(
            "artlike_time_to_first_token_seconds",
            "Streaming requests: time until the first generated token.",
            ["endpoint"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.recorded = Counter(
            "artlike_completions_recorded", "Completion choices written to the completion log.", registry=r
        )
        self.log_failures = Counter(
            "artlike_completion_log_failures",
            "Completions that could not be recorded, by reason.",
            ["reason"],
            registry=r,
        )
        self.log_pending = Gauge(
            "artlike_completion_log_pending_batches", "Write batches waiting for the log writer.", registry=r
        )
        self.adapter_swaps = Counter("artlike_adapter_swaps", "Adapters loaded into the engine.", registry=r)
        self.adapter_swap_seconds = Histogram(
            "artlike_adapter_swap_seconds",
            "Time to load an adapter into the engine.",
            buckets=_SWAP_BUCKETS,
            registry=r,
        )
        self.engine_restarts = Gauge(
            "artlike_engine_restarts", "Engine restarts since the server started.", registry=r
        )
        self.engine_ready = Gauge(
            "artlike_engine_ready", "1 when the engine serves requests, else 0.", registry=r
        )
        self.training_steps = Counter("artlike_training_steps", "Optimizer steps completed.", registry=r)
        self.session_passes = Gauge("artlike_trainer_session_passes",
                                    "Training-session passes (forward_backward, forward) the trainer ran.", registry=r)
        self.fused_passes = Gauge("artlike_trainer_fused_passes",
                                  "Of those, the passes that ran as one pass with other sessions' passes.", registry=r)
        self.training_tokens = Counter("artlike_training_tokens", "Trainable tokens trained on.", registry=r)
        self.training_step_seconds = Histogram(
            "artlike_training_step_seconds",
            "Wall time of one optimizer step.",
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        # Labelled children of the per-request metrics, looked up once: `labels()` validates and locks on
        # every call, and these are updated on every request. The label values are bounded (see above).
        self._per_request: dict[tuple[str, str, int], tuple[Counter, Histogram]] = {}
        self._per_endpoint: dict[str, tuple[Counter, Counter]] = {}

    # --------------------------------------------------------------------------------------- sources

    def track_engine(self, engine: _Engine) -> None:
        """Read the engine's restart count and state at scrape time (no bookkeeping on the engine side)."""
        self.engine_restarts.set_function(lambda: float(engine.restarts))
        self.engine_ready.set_function(lambda: 1.0 if engine.state == "ready" else 0.0)

    def track_engines(self, describe: Callable[[], Sequence[dict[str, Any]]]) -> None:
        """Per-engine series of the pool (`EnginePool.describe`), read at scrape time."""
        self.registry.register(_EngineCollector(describe))

    def set_engine_restarts(self, restarts: int) -> None:
        """For callers that push the count instead (after each engine start); `track_engine` replaces it."""
        self.engine_restarts.set(restarts)

    def track_trainer_passes(self, passes: _Passes) -> None:
        """The training sessions' passes the trainer ran, and how many of them ran fused with another
        session's (`training/pass_batching.py`), read at scrape time."""
        self.session_passes.set_function(lambda: float(passes.passes))
        self.fused_passes.set_function(lambda: float(passes.fused))

    def track_completion_log(self, log: _Log) -> None:
        self.log_pending.set_function(lambda: float(log.pending))

    # ---------------------------------------------------------------------------------------- events

    def request_finished(self, route: str, method: str, status: int, seconds: float) -> None:
        key = (route, method, status)
        if (children := self._per_request.get(key)) is None:
            children = self._per_request[key] = (self.requests.labels(route, method, str(status)),
                                                 self.request_seconds.labels(route))
        requests, request_seconds = children
        requests.inc()
        request_seconds.observe(seconds)

    def tokens(self, endpoint: str, prompt: int, completion: int) -> None:
        if (children := self._per_endpoint.get(endpoint)) is None:
            children = self._per_endpoint[endpoint] = (self.prompt_tokens.labels(endpoint),
                                                       self.completion_tokens.labels(endpoint))
        prompt_tokens, completion_tokens = children
        prompt_tokens.inc(prompt)
        completion_tokens.inc(completion)

    def time_to_first_token(self, endpoint: str, seconds: float) -> None:
        self.ttft_seconds.labels(endpoint).observe(seconds)

    def completions_recorded(self, count: int) -> None:
        self.recorded.inc(count)

    def completion_log_failed(self, reason: str, count: int = 1) -> None:
        self.log_failures.labels(reason).inc(count)

    def adapter_swapped(self, seconds: float) -> None:
        self.adapter_swaps.inc()
        self.adapter_swap_seconds.observe(seconds)

    def training_step(self, tokens: int, seconds: float) -> None:
        self.training_steps.inc()
        self.training_tokens.inc(tokens)
        self.training_step_seconds.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


router = APIRouter()


@router.get("/metrics", include_in_schema=False)
async def metrics_endpoint(request: Request) -> Response:
    metrics: Metrics = request.app.state.artlike.metrics
    return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)


def attach(app: FastAPI) -> None:
    """Include `/metrics` in `app`."""
    app.include_router(router)
