"""The FastAPI app: the middleware stack, each feature's routes, and `/health`, over a server's `Services`.

`create_app(services)` serves parts built elsewhere (a test's fakes, or a caller that owns their lifecycle);
`create_app_from_settings(settings)` builds and starts them in the app's lifespan (`services.build_services`):
the proxy accepts connections at once; while the engine starts or restarts, inference routes answer 503
with Retry-After and `/health` says what is happening. If the engine cannot start at all, `on_fatal` is
called (the CLI stops uvicorn and exits non-zero) with the engine log's tail already logged.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response

from . import metrics as metrics_feature
from .adapter_import import routes as import_feature
from .engine.supervisor import EngineState
from .errors import install_error_handlers
from .export import routes as export_feature
from .hosts import HostPolicy
from .jobs import routes as jobs_feature
from .metrics import Metrics
from .middleware import ApiKeyMiddleware, BodySizeLimitMiddleware, RequestMetricsMiddleware, is_authorized
from .models import routes as models_feature
from .openai_api import routes as openai_feature
from .openai_api.api_router import CompletionRoutes
from .scoring import routes as scoring_feature
from .services import build_services
from .settings import NetworkSettings, ServerSettings
from .state import Services, get_state
from .studio import routes as studio_feature
from .studio.page_logins import PageLogins
from .tinker import routes as tinker_feature
from .training import routes as training_feature


def create_app(services: Services) -> FastAPI:
    """The app serving `services`, which the caller started and will stop."""
    app = _new_app(services.network, services.max_body_bytes, services.metrics, services.page_logins, lifespan=None)
    app.state.artlike = services
    return app


def create_app_from_settings(settings: ServerSettings, *,
                             on_fatal: Callable[[BaseException], None] | None = None) -> FastAPI:
    """The app whose lifespan builds and starts every part from `settings`, and stops them when it ends."""
    metrics = Metrics()
    page_logins = PageLogins(api_key=settings.network.api_key)  # the key check's and the page's log-in's

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with build_services(settings, metrics=metrics, page_logins=page_logins, on_fatal=on_fatal) as services:
            app.state.artlike = services
            yield

    return _new_app(settings.network, settings.limits.max_body_bytes, metrics, page_logins, lifespan=lifespan)


def _new_app(network: NetworkSettings, max_body_bytes: int, metrics: Metrics, page_logins: PageLogins, *,
             lifespan: Any) -> FastAPI:
    app = FastAPI(title="artlike", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(CompletionRoutes)  # innermost: the completion hot path skips FastAPI's layers
    # Outermost last: every request is counted (401/413 too); a bad key is rejected before the body is read.
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=max_body_bytes)
    app.add_middleware(ApiKeyMiddleware, api_key=network.api_key, logins=page_logins,
                       hosts=HostPolicy.from_options(network.allowed_hosts, network.host))
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)
    for feature in (openai_feature, models_feature, training_feature, scoring_feature, jobs_feature,
                    metrics_feature, studio_feature, export_feature, import_feature, tinker_feature):
        feature.attach(app)
    app.add_api_route("/health", health, methods=["GET"])
    return app


async def begin_shutdown(app: FastAPI) -> None:
    """Call when the server starts shutting down, before it waits for open responses: stops managed jobs
    (to be resumed) and cancels training jobs so their NDJSON streams end (with an `error` line) instead
    of running until the job is done."""
    services: Services | None = getattr(app.state, "artlike", None)
    if services is not None:
        # Managed jobs first: their runners stop where they are (still `running`, resumed by the next
        # start) instead of seeing their training step cancelled and failing the job.
        await services.jobs.shutdown()
        await services.continual.shutdown()
        await services.training.shutdown()


async def health(request: Request) -> Response:
    """Up or down for anyone (liveness probes carry no key); pids, dtypes and training only with the key."""
    state = get_state(request)
    engine_state = state.engine.state
    body: dict[str, Any] = {"status": "ok" if engine_state == EngineState.READY else str(engine_state)}
    if is_authorized(request.scope):
        body |= {
            "engine": {"state": str(engine_state), "restarts": state.engine.restarts, "pid": state.engine.pid,
                       "dtype": state.engine_settings.dtype,
                       "dtype_source": state.engine_settings.dtype_source},  # explicit, probe, flags or cuda
            "trainer": {"running": state.trainer.is_running, "pid": state.trainer.pid,
                        "dtype": state.trainer_settings.dtype,
                        "dtype_source": state.trainer_settings.dtype_source},
            "engines": state.engine.describe(),  # each engine: serving?, requests in flight, served, failures
            "models": len(state.models.served_models),  # in memory: /health is polled often
            "training": state.training.active(),
            "training_sessions": state.sessions.open_models(),
            "jobs": state.jobs.running_jobs(),
            "sandbox": state.sandbox.enforcement(),
        }
    headers = {} if engine_state == EngineState.READY else {"Retry-After": str(round(state.engine.retry_after()))}
    return Response(orjson.dumps(body), status_code=200 if engine_state == EngineState.READY else 503,
                    media_type="application/json", headers=headers)
