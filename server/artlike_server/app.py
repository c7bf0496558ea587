"""The FastAPI app: builds the server's parts once, starts the engine, and includes every router.

The proxy accepts connections at once; while the engine starts or restarts, inference routes answer 503
with Retry-After and `/health` says what is happening. If the engine cannot start at all, `on_fatal` is
called (the CLI stops uvicorn and exits non-zero) with the engine log's tail already logged.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import cache
from pathlib import Path
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response

from .completion_log import CompletionLog, RetentionPolicy, prune_periodically
from .engine.errors import EngineError
from .engine.launch import EngineConfig, free_port
from .engine.placement import trainer_owns_its_cores
from .engine.pool_setup import build_engine_pool
from .engine.supervisor import EngineState
from .errors import install_error_handlers
from .hosts import HostPolicy
from .jobs.files import FileStore
from .jobs.files_router import router as files_router
from .jobs.grader_pool import GraderLimits, GraderPool
from .jobs.graders_router import router as graders_router
from .jobs.graders_service import GraderService
from .jobs.intake import check_grade_source
from .jobs.jobs_router import router as jobs_router
from .jobs.rewards import ServerJudge, ServerScorer, python_grader_runner
from .jobs.runner import ServerAccess
from .jobs.sandbox import Sandbox, SandboxLimits
from .jobs.service import JobService
from .jobs.store import JobStore
from .metrics import Metrics
from .metrics import router as metrics_router
from .middleware import ApiKeyMiddleware, BodySizeLimitMiddleware, RequestMetricsMiddleware, is_authorized
from .models.api_router import router as models_router
from .models.manager import ModelManager
from .models.registry import ModelRegistry, ServedBase
from .models.store import ModelStore
from .openai_api.api_router import CompletionRoutes
from .openai_api.api_router import router as openai_router
from .openai_api.dialects.anthropic_messages import MessagesDialect
from .openai_api.dialects.responses import ResponsesDialect
from .openai_api.response_store import ResponseStore
from .openai_api.serving import OpenAIServing
from .scoring.router import router as scoring_router
from .scoring.service import RewardScoring
from .settings import ServerSettings
from .state import AppState, get_state
from .studio.continual import ContinualTrainer
from .studio.ratings import RatingService
from .studio.reward_training import RatingsRewardTrainer
from .studio.router import router as studio_router
from .studio.store import StudioStore
from .studio.trajectories import TrajectoryBrowser
from .studio.ui_router import router as ui_router
from .studio.ui_sessions import UiSessions
from .tensorboard_log import TensorBoardLog
from .tokenizer import load_chat_tokenizer
from .training.adapter_init import TrainerAdapterInitializer
from .training.api_router import router as training_router
from .training.job import TrainingLimits, TrainingService
from .training.sessions import TrainingSessions
from .training.sessions_router import router as sessions_router
from .training.tokenizer_service import TokenizerService
from .training.trainer_client import TrainerProcess

log = logging.getLogger(__name__)


def engine_config(settings: ServerSettings, port: int) -> EngineConfig:
    return EngineConfig(
        model_path=settings.model_path,
        served_model_name=settings.served_model_name,
        port=port,
        dtype=settings.engine_dtype,
        max_lora_rank=settings.max_lora_rank,
        max_loras=settings.max_loaded_adapters,
        max_model_len=settings.max_model_len,
        kv_cache_gib=settings.kv_cache_gib,
        chat_template=str(settings.chat_template) if settings.chat_template else None,
        tool_call_parser=settings.tool_call_parser,
        extra_args=settings.engine_args,
        log_path=settings.log_dir / "engine.log",
        log_max_bytes=settings.log_file_max_bytes,
        log_backups=settings.log_file_backups,
        startup_timeout_s=settings.engine_startup_timeout_s,
        device=settings.device,  # type: ignore[arg-type]
        cpu_ids=settings.engine_cpus,
    )


def retention_policy(settings: ServerSettings) -> RetentionPolicy:
    days = settings.log_retention_days
    return RetentionPolicy(max_age_seconds=days * 86_400 if days else None, max_bytes=settings.log_max_bytes)


def create_app(settings: ServerSettings, *, on_fatal: Callable[[BaseException], None] | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        judge = ServerJudge(self_url(settings), settings.api_key)
        scorer = ServerScorer(self_url(settings), settings.api_key)
        state = _build_state(settings, metrics, judge, scorer, ui_sessions)
        app.state.artlike = state
        state.engine.add_on_ready(state.models.restore)
        metrics.track_engine(state.engine)
        metrics.track_engines(state.engine.describe)
        metrics.track_completion_log(state.log)
        starter = asyncio.create_task(_start_engine_then_trainer(state, on_fatal), name="engine-start")
        pruner = asyncio.create_task(prune_periodically(state.log, retention_policy(settings),
                                                        settings.log_prune_interval_s,
                                                        on_pruned=_prune_responses(state, settings)),
                                     name="log-prune")
        reaper = asyncio.create_task(_reap_idle_sessions(state), name="session-reaper")
        try:
            yield
        finally:
            starter.cancel()
            reaper.cancel()
            await state.jobs.shutdown()
            await state.continual.shutdown()
            await state.sessions.shutdown()
            await state.training.shutdown()  # usually done already (begin_shutdown); a running job holds the trainer
            pruner.cancel()
            await state.trainer.stop()
            await state.engine.stop()  # every local engine, and every engine's connection pool
            state.log.close()
            state.response_store.close()
            state.jobs.store.close()
            state.studio.close()
            if state.tensorboard is not None:
                state.tensorboard.close()
            await state.sandbox.close()
            await state.graders.close()
            await judge.aclose()
            await scorer.aclose()

    metrics = Metrics()
    ui_sessions = UiSessions()  # shared by the key check (middleware) and the page's log-in route
    app = FastAPI(title="artlike", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(CompletionRoutes)  # innermost: the completion hot path skips FastAPI's layers
    # Outermost last: every request is counted (401/413 too); a bad key is rejected before the body is read.
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=settings.max_body_bytes)
    app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key, sessions=ui_sessions,
                       hosts=HostPolicy.from_options(settings.allowed_hosts, settings.host))
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)
    app.include_router(openai_router)
    app.include_router(models_router)
    app.include_router(training_router)
    app.include_router(scoring_router)
    app.include_router(sessions_router)
    app.include_router(files_router)
    app.include_router(graders_router)
    app.include_router(jobs_router)
    app.include_router(metrics_router)
    app.include_router(studio_router)
    app.include_router(ui_router)
    app.add_api_route("/health", health, methods=["GET"])
    return app


async def begin_shutdown(app: FastAPI) -> None:
    """Call when the server starts shutting down, before it waits for open responses: stops managed jobs
    (to be resumed) and cancels training jobs so their NDJSON streams end (with an `error` line) instead
    of running until the job is done."""
    state: AppState | None = getattr(app.state, "artlike", None)
    if state is not None:
        # Managed jobs first: their runners stop where they are (still `running`, resumed by the next
        # start) instead of seeing their training step cancelled and failing the job.
        await state.jobs.shutdown()
        await state.continual.shutdown()
        await state.training.shutdown()


def self_url(settings: ServerSettings) -> str:
    """This server's own URL, for the parts that are its clients (managed jobs, the model judge and scorer)."""
    host = "127.0.0.1" if settings.host in {"", "0.0.0.0"} else "::1" if settings.host == "::" else settings.host
    return f"http://[{host}]:{settings.port}" if ":" in host else f"http://{host}:{settings.port}"


def _build_state(settings: ServerSettings, metrics: Metrics, judge: ServerJudge, scorer: ServerScorer,
                 ui_sessions: UiSessions) -> AppState:
    settings.log_dir.mkdir(parents=True, exist_ok=True)
    completion_log = CompletionLog(settings.data_dir / "completions.sqlite")
    completion_log.open()
    engine = build_engine_pool(settings, engine_config(settings, settings.engine_port or free_port()))
    store = ModelStore(settings.data_dir)
    models = ModelManager(store, engine, settings.served_model_name,
                          max_loaded=settings.max_loaded_adapters, on_swap=metrics.adapter_swapped)
    if engine.policy is not None:  # merged-weights engines follow the alias of the model being trained
        models.alias_observers.append(engine.policy.follow)
        engine.policy.reference = models.step_logprobs
    trainer = TrainerProcess(settings.model_path, dtype=settings.trainer_dtype,
                             gradient_checkpointing=settings.gradient_checkpointing, cpus=settings.trainer_cpus,
                             gpus=settings.trainer_gpus,
                             own_cores=trainer_owns_its_cores(settings.engine_cpus, settings.trainer_cpus,
                                                              settings.engines + settings.policy_engines),
                             log_path=settings.log_dir / "trainer.log", log_max_bytes=settings.log_file_max_bytes,
                             log_backups=settings.log_file_backups)
    chat_template = settings.chat_template.read_text() if settings.chat_template else None
    limits = TrainingLimits(max_records=settings.max_train_records, max_bytes=settings.max_train_bytes,
                            max_sequence_tokens=settings.sequence_token_limit,
                            max_gradient_steps=settings.max_gradient_steps)
    tokenizer = TokenizerService(_tokenizer_loader(settings), chat_template)
    training = TrainingService(store, models, completion_log, trainer, metrics, tokenizer, limits=limits)
    response_store = ResponseStore(settings.data_dir / "responses.sqlite")
    sessions = TrainingSessions(store, models, completion_log, trainer, training)
    # User code sees neither the data dir nor the server's memory: its workers live outside both.
    sandbox_limits = SandboxLimits(call_timeout_s=settings.reward_timeout_s, workers=settings.reward_workers,
                                   memory_bytes=settings.reward_memory_bytes)
    sandbox = Sandbox(Path(tempfile.mkdtemp(prefix="artlike-sandbox-")), hidden_paths=[settings.data_dir],
                      limits=sandbox_limits, allow_unsafe=settings.unsafe_user_code)
    _log_sandbox(sandbox)
    # The text graders' work runs in killable worker processes, never on the event loop.
    grader_pool = GraderPool(GraderLimits(timeout_s=settings.grader_timeout_s, workers=settings.grader_workers,
                                          memory_bytes=settings.grader_memory_bytes,
                                          max_text_chars=settings.max_grader_chars))
    graders = GraderService(python_grader_runner(sandbox), judge, check_source=check_grade_source, scorer=scorer,
                            pool=grader_pool, require_sandbox=sandbox.require)
    jobs = JobService(JobStore(settings.data_dir / "jobs"), sandbox, ServerAccess(self_url(settings), settings.api_key),
                      judge, scorer, compute=graders.compute)
    studio = StudioStore(settings.data_dir / "studio.sqlite")
    training.step_observers.append(studio.record_rewards)  # the trajectory browser's rewards
    continual = ContinualTrainer(studio, training, models, completion_log, engine)
    ratings = RatingService(studio, completion_log, tokenizer.decode_text, on_rated=continual.notify)
    tensorboard = None
    if settings.tensorboard_dir is not None:
        tensorboard = TensorBoardLog(settings.tensorboard_dir)
        models.history_observers.append(tensorboard.write_step)
    registry = ModelRegistry(store, models, TrainerAdapterInitializer(trainer),
                             ServedBase(settings.served_model_name, settings.model_path, settings.max_lora_rank),
                             is_training=training.is_training)
    return AppState(settings=settings, engine=engine, store=store, models=models, registry=registry,
                    log=completion_log, metrics=metrics, trainer=trainer, training=training, sessions=sessions,
                    response_store=response_store, sandbox=sandbox, files=FileStore(settings.data_dir / "files"),
                    graders=graders, jobs=jobs, studio=studio, ratings=ratings, continual=continual,
                    reward_trainer=RatingsRewardTrainer(studio, completion_log, training),
                    trajectories=TrajectoryBrowser(completion_log, studio, tokenizer.decode_text, tokenizer.decode),
                    ui_sessions=ui_sessions, tensorboard=tensorboard,
                    serving=OpenAIServing(engine=engine, upstream=engine, models=models, log=completion_log,
                                          metrics=metrics, settings=settings),
                    scoring=RewardScoring(store, models, completion_log, trainer, tokenizer.conversation_ids,
                                          max_input_tokens=settings.sequence_token_limit),
                    dialects={"responses": ResponsesDialect(response_store), "messages": MessagesDialect()})


def _log_sandbox(sandbox: Sandbox) -> None:
    """Say at start how user code runs here: isolated (and how), unisolated by the operator's choice, or refused."""
    report = sandbox.enforcement()
    if sandbox.isolated:
        log.info("sandbox: user code runs isolated (%s; memory %s)", report["isolation"], report["memory"])
    elif sandbox.allow_unsafe:
        log.warning("sandbox: user code runs UNISOLATED as the server's own user, with its network and files "
                    "(--unsafe-user-code): %s", sandbox.isolation.missing)
    else:
        log.warning("sandbox: %s", sandbox.refusal())


SESSION_REAP_INTERVAL_S = 5.0


async def _reap_idle_sessions(state: AppState) -> None:
    """End training sessions left idle past their timeout; a failure is logged and the loop goes on."""
    while True:
        await asyncio.sleep(SESSION_REAP_INTERVAL_S)
        try:
            await state.sessions.reap_idle()
        except Exception:
            log.exception("ending idle training sessions failed")


def _prune_responses(state: AppState, settings: ServerSettings) -> Callable[[Any], None] | None:
    """Stored Responses API responses age out with the completion log (the same retention in days)."""
    days = settings.log_retention_days
    if not days:
        return None

    def prune(_: Any) -> None:
        task = asyncio.create_task(state.response_store.prune(days * 86_400))
        task.add_done_callback(_log_failure)

    return prune


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("pruning stored responses failed: %r", task.exception())


def _tokenizer_loader(settings: ServerSettings) -> Callable[[], Any]:
    @cache
    def load() -> Any:
        return load_chat_tokenizer(settings.model_path)

    return load


async def _start_engine_then_trainer(state: AppState, on_fatal: Callable[[BaseException], None] | None) -> None:
    try:
        await state.engine.start()
    except EngineError as error:  # no engine started (a local one's log tail, or a misconfigured remote one)
        log.critical("the engine could not start: %s", error)
        if on_fatal is not None:
            on_fatal(error)
        return
    except Exception as error:  # anything else (a bug in a start-up step): never /health 503 forever
        log.critical("the server could not start: %s: %s", type(error).__name__, error, exc_info=error)
        if on_fatal is not None:
            on_fatal(error)
        return
    # The trainer loads its own copy of the base model; start it after the engine so the two start-ups
    # don't compete for the same cores, and so the first /_train_model or register is fast.
    try:
        await state.trainer.start()
    except Exception:
        log.exception("the trainer did not start; training requests will retry starting it")
    try:
        await asyncio.to_thread(state.training.tokenizer.load)
    except Exception:
        log.exception("the tokenizer did not load; requests with offline trajectories will retry")
    state.jobs.start()  # managed jobs are clients of the engine and trainer: start (or resume) them now
    state.continual.start()  # ratings that arrived while the server was down may make a step due


async def health(request: Request) -> Response:
    """Up or down for anyone (liveness probes carry no key); pids, dtypes and training only with the key."""
    state = get_state(request)
    engine_state = state.engine.state
    body: dict[str, Any] = {"status": "ok" if engine_state == EngineState.READY else str(engine_state)}
    if is_authorized(request.scope):
        body |= {
            "engine": {"state": str(engine_state), "restarts": state.engine.restarts, "pid": state.engine.pid,
                       "dtype": state.settings.engine_dtype,
                       "dtype_source": state.settings.engine_dtype_source},  # explicit, probe, flags or cuda
            "trainer": {"running": state.trainer.is_running, "pid": state.trainer.pid,
                        "dtype": state.settings.trainer_dtype,
                        "dtype_source": state.settings.trainer_dtype_source},
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
