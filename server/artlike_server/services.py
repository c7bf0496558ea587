"""The composition root: builds every part of one server from its settings, wires who observes whom, starts
the parts in dependency order and stops them in reverse.

`build_services(settings)` is an async context manager. Each part's stop is pushed on an `AsyncExitStack`
right after the part is built, so leaving the block stops them newest first, and a stop that raises does
not skip the stops after it (the first error is raised once all have run). The engine starts in the
background: the proxy accepts connections at once; if the engine cannot start at all `on_fatal` is called.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from functools import cache
from pathlib import Path
from typing import Any

from .adapter_import.service import ImportService
from .completion_log import CompletionLog, RetentionPolicy, prune_periodically
from .engine.errors import EngineError
from .engine.launch import EngineConfig, free_port
from .engine.placement import trainer_owns_its_cores
from .engine.pool_setup import build_engine_pool
from .export.service import ExportService
from .jobs.files import FileStore
from .jobs.grader_pool import GraderLimits, GraderPool
from .jobs.graders_service import GraderService
from .jobs.intake import check_grade_source
from .jobs.rewards import ServerJudge, ServerScorer, python_grader_runner
from .jobs.runner import ServerAccess
from .jobs.sandbox import Sandbox, SandboxLimits
from .jobs.service import JobService
from .jobs.store import JobStore
from .metrics import Metrics
from .models.manager import ModelManager
from .models.registry import ModelRegistry
from .models.store import ModelStore
from .openai_api.dialects.anthropic_messages import MessagesDialect
from .openai_api.dialects.responses import ResponsesDialect
from .openai_api.policy import RequestPolicy
from .openai_api.response_store import ResponseStore
from .openai_api.serving import OpenAIServing
from .scoring.service import RewardScoring
from .settings import ServerSettings, TrackerSettings
from .state import BaseModelInfo, Services
from .studio.continual import ContinualTrainer
from .studio.page_logins import PageLogins
from .studio.ratings import RatingService
from .studio.reward_training import RatingsRewardTrainer
from .studio.store import StudioStore
from .studio.trajectories import TrajectoryBrowser
from .tinker.service import TinkerService
from .tokenizer import load_chat_tokenizer
from .trackers.base import Tracker, Trackers
from .training.adapter_init import TrainerAdapterInitializer
from .training.job import TrainingLimits, TrainingService
from .training.sessions import TrainingSessions
from .training.tokenizer_service import TokenizerService
from .training.trainer_client import TrainerProcess

log = logging.getLogger(__name__)

SESSION_REAP_INTERVAL_S = 5.0


def engine_config(settings: ServerSettings, port: int) -> EngineConfig:
    engine, retention = settings.engine, settings.retention
    return EngineConfig(
        model_path=settings.model_path,
        served_model_name=settings.served_model_name,
        port=port,
        dtype=engine.dtype,
        max_lora_rank=engine.max_lora_rank,
        max_loras=engine.max_loaded_adapters,
        max_model_len=engine.max_model_len,
        kv_cache_gib=engine.kv_cache_gib,
        chat_template=engine.chat_template,
        tool_call_parser=engine.tool_call_parser,
        extra_args=engine.args,
        log_path=settings.log_dir / "engine.log",
        log_max_bytes=retention.log_file_max_bytes,
        log_backups=retention.log_file_backups,
        startup_timeout_s=engine.startup_timeout_s,
        device=engine.device,  # type: ignore[arg-type]
        cpu_ids=engine.cpus,
    )


def self_url(host: str, port: int) -> str:
    """This server's own URL, for the parts that are its clients (managed jobs, the model judge and scorer)."""
    host = "127.0.0.1" if host in {"", "0.0.0.0"} else "::1" if host == "::" else host
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@asynccontextmanager
async def build_services(settings: ServerSettings, *, metrics: Metrics | None = None,
                         page_logins: PageLogins | None = None,
                         on_fatal: Callable[[BaseException], None] | None = None) -> AsyncIterator[Services]:
    """Every part of one server, started; stopped in reverse order when the block ends, whatever fails.

    `metrics` and `page_logins` may be given when the app's middleware holds them before the parts exist.
    """
    metrics = metrics or Metrics()
    page_logins = page_logins or PageLogins(api_key=settings.network.api_key)
    network, retention, sandbox_settings = settings.network, settings.retention, settings.sandbox
    own_url = self_url(network.host, network.port)
    async with AsyncExitStack() as stack:
        judge = ServerJudge(own_url, network.api_key)
        stack.push_async_callback(judge.aclose)
        scorer = ServerScorer(own_url, network.api_key)
        stack.push_async_callback(scorer.aclose)
        settings.log_dir.mkdir(parents=True, exist_ok=True)

        completion_log = CompletionLog(settings.data_dir / "completions.sqlite")
        completion_log.open()
        stack.callback(completion_log.close)
        metrics.track_completion_log(completion_log)

        engine = build_engine_pool(settings.scale_out, engine_config(settings, settings.engine.port or free_port()),
                                   api_key=settings.engine.api_key)
        stack.push_async_callback(engine.stop)  # every local engine, and every engine's connection pool
        metrics.track_engine(engine)
        metrics.track_engines(engine.describe)

        store = ModelStore(settings.data_dir)
        models = ModelManager(store, engine, settings.served_model_name,
                              max_loaded=settings.engine.max_loaded_adapters, on_swap=metrics.adapter_swapped)
        engine.add_on_ready(models.restore)  # a (re)started engine loads the adapters it served
        if engine.policy is not None:  # merged-weights engines follow the alias of the model being trained
            models.alias_observers.append(engine.policy.follow)
            engine.policy.reference = models.step_logprobs

        trainer = TrainerProcess(
            settings.model_path, dtype=settings.trainer.dtype,  # type: ignore[arg-type]  # resolved by the CLI
            gradient_checkpointing=settings.trainer.gradient_checkpointing, cpus=settings.trainer.cpus,
            gpus=settings.trainer.gpus, fuse_passes=settings.trainer.fuse_passes,
            own_cores=trainer_owns_its_cores(settings.engine.cpus, settings.trainer.cpus,
                                             settings.scale_out.local_engines),
            log_path=settings.log_dir / "trainer.log", log_max_bytes=retention.log_file_max_bytes,
            log_backups=retention.log_file_backups)
        stack.push_async_callback(trainer.stop)
        metrics.track_trainer_passes(trainer.passes)

        chat_template = _chat_template_text(settings)
        limits = TrainingLimits(max_records=settings.limits.max_train_records,
                                max_bytes=settings.limits.max_train_bytes,
                                max_sequence_tokens=settings.sequence_token_limit,
                                max_gradient_steps=settings.limits.max_gradient_steps)
        tokenizer = TokenizerService(_tokenizer_loader(settings), chat_template)
        training = TrainingService(store, models, completion_log, trainer, metrics, tokenizer, limits=limits)
        # usually done already (the CLI's begin_shutdown); a running job holds the trainer
        stack.push_async_callback(training.shutdown)

        response_store = ResponseStore(settings.data_dir / "responses.sqlite")
        stack.callback(response_store.close)
        sessions = TrainingSessions(store, models, completion_log, trainer, training)
        stack.push_async_callback(sessions.shutdown)

        # User code sees neither the data dir nor the server's memory: its workers live outside both.
        sandbox = Sandbox(Path(tempfile.mkdtemp(prefix="artlike-sandbox-")), hidden_paths=[settings.data_dir],
                          limits=SandboxLimits(call_timeout_s=sandbox_settings.reward_timeout_s,
                                               workers=sandbox_settings.reward_workers,
                                               memory_bytes=sandbox_settings.reward_memory_bytes),
                          allow_unsafe=sandbox_settings.unsafe_user_code)
        stack.push_async_callback(sandbox.close)
        _log_sandbox(sandbox)
        # The text graders' work runs in killable worker processes, never on the event loop.
        grader_pool = GraderPool(GraderLimits(timeout_s=sandbox_settings.grader_timeout_s,
                                              workers=sandbox_settings.grader_workers,
                                              memory_bytes=sandbox_settings.grader_memory_bytes,
                                              max_text_chars=sandbox_settings.max_grader_chars))
        graders = GraderService(python_grader_runner(sandbox), judge, check_source=check_grade_source,
                                scorer=scorer, pool=grader_pool, require_sandbox=sandbox.require)
        stack.push_async_callback(graders.close)

        job_store = JobStore(settings.data_dir / "jobs")
        stack.callback(job_store.close)
        jobs = JobService(job_store, sandbox, ServerAccess(own_url, network.api_key), judge, scorer,
                          compute=graders.compute)
        stack.push_async_callback(jobs.shutdown)

        studio = StudioStore(settings.data_dir / "studio.sqlite")
        stack.callback(studio.close)
        training.step_observers.append(studio.record_rewards)  # the trajectory browser's rewards
        continual = ContinualTrainer(studio, training, models, completion_log, engine)
        stack.push_async_callback(continual.shutdown)
        ratings = RatingService(studio, completion_log, tokenizer.decode_text, on_rated=continual.notify)

        exports = ExportService(settings.data_dir, settings.model_path)
        trackers = build_trackers(settings.trackers)
        if trackers is not None:
            stack.callback(trackers.close)
            models.history_observers.append(trackers.observe_history)
            jobs.config_observers.append(trackers.train_config)
            exports.observers.append(trackers.exported)

        base_model = BaseModelInfo(settings.served_model_name, settings.model_path, settings.engine.max_lora_rank)
        registry = ModelRegistry(store, models, TrainerAdapterInitializer(trainer), base_model,
                                 is_training=training.is_training)
        requests = request_policy(settings)
        serving = OpenAIServing(engine=engine, upstream=engine, models=models, log=completion_log, metrics=metrics,
                                settings=requests)
        tinker = TinkerService(base=base_model, data_dir=settings.data_dir, store=store, models=models,
                               registry=registry, sessions=sessions, serving=serving)
        stack.push_async_callback(tinker.stop)  # before the sessions stop: its queued operations fail first
        services = Services(
            base_model=base_model, registry=registry, serving=serving, tinker=tinker,
            reward_trainer=RatingsRewardTrainer(studio, completion_log, training),
            network=network, max_body_bytes=settings.limits.max_body_bytes, engine_settings=settings.engine, trainer_settings=settings.trainer,
            requests=requests, engine=engine, store=store, models=models, log=completion_log,
            metrics=metrics, trainer=trainer, training=training, sessions=sessions, response_store=response_store,
            sandbox=sandbox, files=FileStore(settings.data_dir / "files"), graders=graders, jobs=jobs,
            studio=studio, ratings=ratings, continual=continual,
            trajectories=TrajectoryBrowser(completion_log, studio, tokenizer.decode_text, tokenizer.decode),
            page_logins=page_logins, trackers=trackers,
            scoring=RewardScoring(store, models, completion_log, trainer, tokenizer.conversation_ids,
                                  max_input_tokens=settings.sequence_token_limit),
            exports=exports,
            imports=ImportService(settings.data_dir, registry),
            dialects={"responses": ResponsesDialect(response_store), "messages": MessagesDialect()})

        days = retention.log_retention_days
        _background(stack, prune_periodically(
            completion_log, RetentionPolicy(max_age_seconds=retention.max_age_seconds,
                                            max_bytes=retention.max_log_bytes),
            retention.log_prune_interval_s, on_pruned=_prune_responses(response_store, days) if days else None),
            "log-prune")
        _background(stack, start_engine_then_trainer(services, on_fatal), "engine-start")
        _background(stack, _reap_idle_sessions(sessions), "session-reaper")
        yield services


def build_trackers(settings: TrackerSettings) -> Trackers | None:
    """The experiment trackers asked for (None: none). Each library is imported only here, when its option is
    set; W&B and MLflow write on their own threads (they may talk to a server)."""
    trackers: list[Tracker] = []
    if settings.tensorboard_dir is not None:
        from .trackers.tensorboard import TensorBoardLog

        trackers.append(TensorBoardLog(settings.tensorboard_dir))
    if settings.wandb_project is not None:
        from .trackers.background import BackgroundTracker
        from .trackers.weights_and_biases import WandbTracker

        trackers.append(BackgroundTracker(WandbTracker(settings.wandb_project, entity=settings.wandb_entity,
                                                       run_name_prefix=settings.wandb_run_name), "wandb"))
    if settings.mlflow_tracking_uri is not None:
        from .trackers.background import BackgroundTracker
        from .trackers.mlflow_runs import MlflowTracker

        trackers.append(BackgroundTracker(MlflowTracker(settings.mlflow_tracking_uri, settings.mlflow_experiment),
                                          "mlflow"))
    return Trackers(trackers) if trackers else None


def request_policy(settings: ServerSettings) -> RequestPolicy:
    return RequestPolicy(reject_seed=bool(settings.limits.reject_seed),
                         max_recorded_choices=settings.limits.max_recorded_choices,
                         max_request_tokens=settings.limits.max_request_tokens,
                         max_model_len=settings.engine.max_model_len)


def _background(stack: AsyncExitStack, work: Any, name: str) -> None:
    """Run `work` as a task that the stack cancels when it unwinds (before the parts it uses stop)."""
    task = asyncio.create_task(work, name=name)
    stack.callback(task.cancel)


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


async def _reap_idle_sessions(sessions: TrainingSessions) -> None:
    """End training sessions left idle past their timeout; a failure is logged and the loop goes on."""
    while True:
        await asyncio.sleep(SESSION_REAP_INTERVAL_S)
        try:
            await sessions.reap_idle()
        except Exception:
            log.exception("ending idle training sessions failed")


def _prune_responses(response_store: ResponseStore, days: float) -> Callable[[Any], None]:
    """Stored Responses API responses age out with the completion log (the same retention in days)."""

    def prune(_: Any) -> None:
        task = asyncio.create_task(response_store.prune(days * 86_400))
        task.add_done_callback(_log_failure)

    return prune


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("pruning stored responses failed: %r", task.exception())


def _chat_template_text(settings: ServerSettings) -> str | None:
    """The engine's chat template (a file the CLI resolved), for the trainer's sequences to match it."""
    return Path(settings.engine.chat_template).read_text() if settings.engine.chat_template else None


def _tokenizer_loader(settings: ServerSettings) -> Callable[[], Any]:
    @cache
    def load() -> Any:
        return load_chat_tokenizer(settings.model_path)

    return load


async def start_engine_then_trainer(services: Services, on_fatal: Callable[[BaseException], None] | None) -> None:
    try:
        await services.engine.start()
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
        await services.trainer.start()
    except Exception:
        log.exception("the trainer did not start; training requests will retry starting it")
    try:
        await asyncio.to_thread(services.training.tokenizer.load)
    except Exception:
        log.exception("the tokenizer did not load; requests with offline trajectories will retry")
    services.jobs.start()  # managed jobs are clients of the engine and trainer: start (or resume) them now
    services.continual.start()  # ratings that arrived while the server was down may make a step due
