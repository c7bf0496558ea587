"""`TrainableModel`: a LoRA adapter on the server's base model, served and trained step by step.

Every network method is async; its sync variant has the same name with a `_sync` suffix
(`register_sync`, `get_step_sync`, `list_steps_sync`, `delete_steps_sync`, `train_sync`, ...) for scripts
and notebooks, generated from it (`_syncify`). `trajectory()` needs no network and works with `async with` and `with`.

A model registered with `kind="reward"` is a reward model: a scalar head on the LoRA, trained with
`train_reward_model(pairs=..., scored=...)` and asked with `score(inputs)`; it does not generate.
"""

from __future__ import annotations

import os
from collections.abc import AsyncGenerator, Callable, Iterable, Mapping
from contextlib import aclosing
from types import TracebackType
from typing import Any

import httpx

from ._backend import Backend
from ._dpo import Pair, build_dpo_request, to_pair
from ._errors import BadRequestError
from ._http import DEFAULT_TIMEOUT, Connection, RetryPolicy
from ._rewards import ScoreInput, score_with
from ._session import TrainingSession
from ._sft import Example, build_sft_request
from ._syncify import run_sync, syncify
from ._train import (
    DEFAULT_IDLE_TIMEOUT,
    AnyEvent,
    TrainResult,
    TrainStream,
    build_train_request,
    skipped_step_line,
)
from ._trajectory import Trajectory, TrajectoryGroup
from .types import (
    EvaluationRequest,
    LoraConfig,
    ModelInfo,
    ModelKind,
    RegisterModelRequest,
    RewardHeadConfig,
    RewardModelConfig,
    RewardScore,
    ScoredExample,
    StepInfo,
    StepRetention,
    TrainConfig,
    TrainRequest,
    UpdateModelRequest,
    train_config,
)

__all__ = ["TrainableModel"]

Groups = Iterable[TrajectoryGroup | Iterable[Trajectory]]


class TrainableModel:
    """A trainable model on an artlike server: `name` serves its latest step, `name@N` step N.

        model = art.TrainableModel("mail-agent", "Qwen/Qwen2.5-7B-Instruct", "http://gpu-box:8000")
        await model.register()            # step 0: a fresh LoRA, identical to the base model

    `kind="reward"` registers a reward model instead of a policy (`reward_head`: its `RewardHeadConfig`,
    default one objective with last-token pooling).
    `api_key` defaults to the ARTLIKE_API_KEY environment variable (read here, not at import).
    `transport`/`sync_transport` replace httpx's network transport (tests, in-process ASGI apps).
    """

    def __init__(
        self,
        name: str,
        base_model: str,
        server: str,
        *,
        lora: LoraConfig | Mapping[str, Any] | None = None,
        retention: StepRetention | Mapping[str, Any] | None = None,
        kind: ModelKind = "policy",
        reward_head: RewardHeadConfig | Mapping[str, Any] | None = None,
        api_key: str | None = None,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT,
        retry: RetryPolicy | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        sync_transport: httpx.BaseTransport | None = None,
    ) -> None:
        # Validates the name (no '@' or '/') and the LoRA config now, not at the first request.
        self._registration = RegisterModelRequest(
            name=name, base_model=base_model, lora=LoraConfig.model_validate(lora if lora is not None else {}),
            retention=StepRetention.model_validate(retention) if retention is not None else None,
            kind=kind, reward_head=RewardHeadConfig.model_validate(reward_head) if reward_head is not None else None,
        )
        self._backend = Backend(Connection(
            server,
            api_key=api_key if api_key is not None else os.environ.get("ARTLIKE_API_KEY"),
            timeout=timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout),
            retry=retry,
            transport=transport,
            sync_transport=sync_transport,
        ))

    @property
    def name(self) -> str:
        return self._registration.name

    @property
    def base_model(self) -> str:
        return self._registration.base_model

    @property
    def lora(self) -> LoraConfig:
        return self._registration.lora

    @property
    def kind(self) -> ModelKind:
        """The model's kind: "policy" (served for chat, trained on rollouts) or "reward" (a scorer)."""
        return self._registration.kind

    @property
    def reward_head(self) -> RewardHeadConfig | None:
        return self._registration.reward_head

    @property
    def server(self) -> str:
        return self._backend.connection.base_url

    @property
    def inference_base_url(self) -> str:
        """The plain OpenAI base URL (not recorded): for evaluation, `model=name` or `name@N`."""
        return f"{self.server}/v1"

    def __repr__(self) -> str:
        kind = ", kind='reward'" if self.kind == "reward" else ""
        return f"TrainableModel(name={self.name!r}, base_model={self.base_model!r}, server={self.server!r}{kind})"

    # ------------------------------------------------------------------------------------ registry

    async def register(self) -> ModelInfo:
        """Create the model (step 0) or return it when it exists with the same config.

        Raises ConflictError when the name exists with another config, BadRequestError when the
        server serves another base model.
        """
        return await self._backend.register_model(self._registration)

    async def get_info(self) -> ModelInfo:
        return await self._backend.get_model(self.name)

    async def get_step(self) -> int:
        """The latest step, the one served under `name`."""
        return (await self.get_info()).latest_step

    async def list_steps(self) -> list[StepInfo]:
        return await self._backend.list_steps(self.name)

    async def delete_steps(self, *, keep: int) -> list[int]:
        """Delete all but the latest `keep` steps from disk and the engine; returns the deleted step numbers."""
        return await self._backend.delete_steps(self.name, _check_keep(keep))

    async def set_retention(self, retention: StepRetention | Mapping[str, Any]) -> ModelInfo:
        """Change which steps the server keeps (`keep_last`, `keep_best`); applied at once and after every step."""
        return await self._backend.update_model(
            self.name, UpdateModelRequest(retention=StepRetention.model_validate(retention)))

    async def log_evaluation(self, step: int, metrics: Mapping[str, float], *, split: str = "validation"
                             ) -> dict[str, Any]:
        """Record step `step`'s scores on held-out data in the model's history (`"event": "eval"`): TensorBoard
        shows them as `eval/*`, and a retention `keep_best` on `"eval.<metric>"` keeps the best evaluated steps."""
        return await self._backend.log_evaluation(
            self.name, EvaluationRequest(step=step, metrics=dict(metrics), split=split))

    register_sync = syncify(register)
    get_info_sync = syncify(get_info)
    get_step_sync = syncify(get_step)
    list_steps_sync = syncify(list_steps)
    delete_steps_sync = syncify(delete_steps)
    set_retention_sync = syncify(set_retention)
    log_evaluation_sync = syncify(log_evaluation)

    # -------------------------------------------------------------------------------- trajectories

    def trajectory(self, *, metadata: Mapping[str, Any] | None = None) -> Trajectory:
        """A new recorded trajectory: use `t.base_url` and `model=t.model` in any OpenAI client.

            async with model.trajectory() as t:
                client = t.async_openai_client()
                ...
                t.reward = score
        """
        return Trajectory._recorded(self._backend, self.name, metadata)

    # ------------------------------------------------------------------------------------- scoring

    async def score(self, inputs: Iterable[ScoreInput], *, step: int | None = None) -> list[RewardScore]:
        """This reward model's scores of `inputs` (`POST /v1/rewards`), one `RewardScore` per input in order:
        recorded trajectories (their last recorded answer, token-exact), offline ones, chat message lists
        ending with the answer, or wire dicts. `step`: that step instead of the one the alias serves."""
        return await score_with(self._backend, self._reference(step), inputs)

    score_sync = syncify(score)

    def _reference(self, step: int | None) -> str:
        return self.name if step is None else f"{self.name}@{step}"

    # ------------------------------------------------------------------------------------ training

    def train(
        self,
        groups: Groups,
        *,
        config: TrainConfig | None = None,
        progress: bool = True,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
        strict: bool = False,
        **options: Any,
    ) -> TrainStream:
        """One training step on `groups`: `async for event in model.train(...)` or `await model.train(...)`.

        Options are the fields of the objective's config (`objective="cispo"`, `learning_rate=1e-5`, ...; see
        `GRPOConfig`, `CISPOConfig`, `GSPOConfig`, `PPOConfig`) or a whole `config=`; they are
        validated here, before any request (pydantic ValidationError). Failed trajectories are left out.
        `idle_timeout`: seconds without any stream line (the server sends heartbeats) before giving up.
        A batch without signal (every group's rewards equal) trains nothing: the result has `trained=False`
        and the reason, a `NoSignalWarning` is issued and the served step stays, so a loop goes on;
        `strict=True` raises the server's `BadRequestError` (code "no_signal") instead.
        With `objective="ppo", reward_model="rm"` (or "rm@N") a trajectory may leave `reward` unset: the reward
        model scores it (a reward that is set is added to the score).
        """
        return self._stream(build_train_request(self.name, groups, _train_config(config, options)), progress,
                            idle_timeout, strict=strict)

    def train_sync(
        self,
        groups: Groups,
        *,
        config: TrainConfig | None = None,
        progress: bool = True,
        on_event: Callable[[AnyEvent], None] | None = None,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
        strict: bool = False,
        **options: Any,
    ) -> TrainResult:
        """`train` for sync code: runs the step and returns its result; `on_event` sees every event."""
        return run_sync(self.train(groups, config=config, progress=progress, idle_timeout=idle_timeout, strict=strict,
                                   **options)._collect(on_event))

    def train_sft(
        self,
        examples: Iterable[Example],
        *,
        config: TrainConfig | None = None,
        progress: bool = True,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
        **options: Any,
    ) -> TrainStream:
        """Supervised fine-tuning on `examples`: recorded trajectories (their exact sampled tokens), offline
        ones, or chat message lists (rendered with the served chat template). Options are `SFTConfig` fields
        (`learning_rate=1e-4`, `epochs`, `assistant_turns="last"`, `lr_schedule`, `warmup_steps`, ...).
        Iterate or await it like `train`. `art.best_of_groups(groups)` picks examples from rollouts.
        """
        sft = _train_config(config, {"objective": "sft", **options} if config is None else {})
        return self._stream(build_sft_request(self.name, examples, sft), progress, idle_timeout)

    def train_sft_sync(
        self,
        examples: Iterable[Example],
        *,
        config: TrainConfig | None = None,
        progress: bool = True,
        on_event: Callable[[AnyEvent], None] | None = None,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
        **options: Any,
    ) -> TrainResult:
        """`train_sft` for sync code."""
        return run_sync(self.train_sft(examples, config=config, progress=progress, idle_timeout=idle_timeout,
                                       **options)._collect(on_event))

    def train_dpo(
        self,
        pairs: Iterable[Pair],
        *,
        config: TrainConfig | None = None,
        progress: bool = True,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
        **options: Any,
    ) -> TrainStream:
        """Direct preference optimisation on `pairs`: `(chosen, rejected)` recorded trajectories (their exact
        sampled tokens) or `{"prompt": [...], "chosen": ..., "rejected": ...}` messages. Options are
        `DPOConfig` fields (`beta`, `loss_type`, `label_smoothing`, `reference="name@N"`, `reference_free`,
        `learning_rate`, `epochs`, ...). Iterate or await it like `train`; `art.preference_pairs(groups)`
        makes pairs from rollouts."""
        dpo = _train_config(config, {"objective": "dpo", **options} if config is None else {})
        return self._stream(build_dpo_request(self.name, pairs, dpo), progress, idle_timeout)

    def train_dpo_sync(
        self,
        pairs: Iterable[Pair],
        *,
        config: TrainConfig | None = None,
        progress: bool = True,
        on_event: Callable[[AnyEvent], None] | None = None,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
        **options: Any,
    ) -> TrainResult:
        """`train_dpo` for sync code."""
        return run_sync(self.train_dpo(pairs, config=config, progress=progress, idle_timeout=idle_timeout,
                                       **options)._collect(on_event))

    def train_reward_model(
        self,
        *,
        pairs: Iterable[Pair] = (),
        scored: Iterable[ScoredExample | Mapping[str, Any]] = (),
        config: TrainConfig | None = None,
        progress: bool = True,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
        **options: Any,
    ) -> TrainStream:
        """Train this reward model (registered with `kind="reward"`) on preference `pairs` (as for `train_dpo`:
        the Bradley–Terry loss on their scores) and/or `scored` examples (`ScoredExample`s or their dicts:
        `{"messages"` or `"trajectory_id", "completion_id"?, "targets": [one per objective]}`). Options are
        `RewardModelConfig` fields (`margin`, `label_smoothing`, `regression_weight`, `learning_rate`,
        `epochs`, ...). Iterate or await it like `train`."""
        return self._stream(self._reward_model_request(pairs, scored, config, options), progress, idle_timeout)

    def train_reward_model_sync(
        self,
        *,
        pairs: Iterable[Pair] = (),
        scored: Iterable[ScoredExample | Mapping[str, Any]] = (),
        config: TrainConfig | None = None,
        progress: bool = True,
        on_event: Callable[[AnyEvent], None] | None = None,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
        **options: Any,
    ) -> TrainResult:
        """`train_reward_model` for sync code."""
        return run_sync(self.train_reward_model(pairs=pairs, scored=scored, config=config, progress=progress,
                                                idle_timeout=idle_timeout, **options)._collect(on_event))

    def _reward_model_request(self, pairs: Iterable[Pair], scored: Iterable[ScoredExample | Mapping[str, Any]],
                              config: TrainConfig | None, options: dict[str, Any]) -> TrainRequest:
        rm = _train_config(config, {"objective": "reward_model", **options} if config is None else options)
        if not isinstance(rm, RewardModelConfig):
            raise ValueError(f"train_reward_model needs a reward model config, not objective {rm.objective!r}")
        wire_pairs = [to_pair(pair) for pair in pairs]
        wire_scored = [ScoredExample.model_validate(dict(s) if isinstance(s, Mapping) else s) for s in scored]
        if not wire_pairs and not wire_scored:
            raise ValueError("nothing to train on: no pairs and no scored examples")
        return TrainRequest(model=self.name, config=rm, pairs=wire_pairs, scored=wire_scored)

    async def training_session(self, *, from_step: int | None = None, idle_timeout_s: float = 600.0,
                               **optimizer: Any) -> TrainingSession:
        """Open a training session (low-level primitives: forward_backward, optim_step, save_state...) on this
        model, from `from_step` (default: the latest); `optimizer` holds AdamW's `learning_rate`, `betas`,
        `eps`, `weight_decay`, `max_grad_norm`. Use it with `async with` to end it."""
        return await TrainingSession.open(self._backend.connection, self.name, from_step=from_step,
                                          idle_timeout_s=idle_timeout_s, **optimizer)

    training_session_sync = syncify(training_session, doc="`training_session` for sync code (use it with `with`).")

    def _stream(self, request: TrainRequest, progress: bool, idle_timeout: float, *, strict: bool = True
                ) -> TrainStream:
        body = request.model_dump(mode="json")

        async def lines() -> AsyncGenerator[str, None]:
            try:
                async with aclosing(self._backend.train_lines(body, idle_timeout)) as stream:
                    async for line in stream:
                        yield line
            except BadRequestError as error:
                if strict or error.code != "no_signal":
                    raise
                yield skipped_step_line(self.name, await self.get_step(), error.message)

        return TrainStream(lines, model=self.name, progress=progress)

    # --------------------------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Close an injected sync-only transport (`sync_transport=`); no call keeps a connection open."""
        self._backend.connection.close()

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> TrainableModel:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        await self.aclose()

    def __enter__(self) -> TrainableModel:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


def _train_config(config: TrainConfig | None, options: dict[str, Any]) -> TrainConfig:
    if config is not None and options:
        raise TypeError(f"pass either config= or TrainConfig fields as keywords, not both (got {sorted(options)})")
    return config if config is not None else train_config(**options)


def _check_keep(keep: int) -> int:
    if keep < 1:
        raise ValueError(f"keep must be >= 1 (the latest step is always kept), got {keep}")
    return keep
