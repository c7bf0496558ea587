"""An engine someone else runs (`artlike serve --engine-url URL`): watched, never started or stopped.

    stopped ──start()──▶ ready            (healthy, serves our base model, on_ready callbacks done)
                    └──▶ restarting       (down: unreachable, or on_ready failed; polled until it is back)
    ready ── N failed health checks ──▶ restarting ── healthy + on_ready ──▶ ready (restarts += 1)
    misconfigured (401 on our key, another base model) ──▶ failed (start() raises RemoteEngineError)

The engine must be a vLLM OpenAI server serving the same base model under the same name, with runtime
LoRA updating on (`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`, `--enable-lora`, `--max-loras` at least the
proxy's `--max-loaded-adapters`), and able to read the adapter directories by the paths the proxy sends
(a shared filesystem mounted at the same path as the proxy's data dir). The same interface as
`EngineSupervisor` (state, restarts, retry_after, start/stop, on_ready), so the pool treats both alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

import httpx

from .client import EngineClient, EngineRequestError
from .errors import EngineError
from .supervisor import EngineState, OnReady, SupervisionPolicy

logger = logging.getLogger(__name__)


class RemoteEngineError(EngineError):
    """The remote engine answers, but cannot serve for this proxy (wrong key, another base model)."""


class RemoteEngine:
    """Health-watches one remote vLLM server at `client.base_url`."""

    def __init__(self, client: EngineClient, served_model_name: str, *, policy: SupervisionPolicy | None = None,
                 on_ready: Sequence[OnReady] = ()) -> None:
        self.client = client
        self.served_model_name = served_model_name
        self.policy = policy or SupervisionPolicy()
        self._on_ready = list(on_ready)
        self._state = EngineState.STOPPED
        self._restarts = 0
        self._monitor_task: asyncio.Task[None] | None = None
        self.last_error: str | None = None

    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def base_url(self) -> str:
        return self.client.base_url

    @property
    def restarts(self) -> int:
        """Times the engine came back after being down."""
        return self._restarts

    @property
    def pid(self) -> int | None:
        return None  # not ours

    def add_on_ready(self, callback: OnReady) -> None:
        self._on_ready.append(callback)

    def retry_after(self) -> float:
        if self._state is EngineState.READY:
            return 0.0
        if self._state is EngineState.FAILED:
            return self.policy.failed_retry_after_s
        return self.policy.health_interval_s

    async def start(self) -> None:
        """Check the engine once and start watching it. Raises RemoteEngineError when it answers but is
        misconfigured; an unreachable engine is not an error here (it is polled until it answers)."""
        self._state = EngineState.STARTING
        if not await self._try_join():
            self._state = EngineState.RESTARTING
            logger.warning("remote engine %s is not serving yet (%s); polling it", self.base_url, self.last_error)
        self._monitor_task = asyncio.create_task(self._watch(), name=f"artlike-remote-engine-{self.base_url}")

    async def stop(self) -> None:
        if self._monitor_task is not None:
            self._monitor_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor_task
        self._state = EngineState.STOPPED

    async def _try_join(self) -> bool:
        """True when the engine is healthy, serves our model and the on_ready callbacks succeeded."""
        if not await self.client.is_healthy(timeout_s=self.policy.health_timeout_s):
            self.last_error = "health check failed"
            return False
        try:
            listed = {model.id for model in await self.client.list_models()}
        except httpx.TransportError as error:
            self.last_error = f"GET /v1/models failed: {error!r}"
            return False
        except EngineRequestError as error:
            self._state = EngineState.FAILED
            self.last_error = str(error)
            hint = " (is --engine-key right?)" if error.status in (401, 403) else ""
            raise RemoteEngineError(f"the engine at {self.base_url} refused GET /v1/models{hint}: {error}") from error
        if self.served_model_name not in listed:
            self._state = EngineState.FAILED
            self.last_error = f"serves {sorted(listed)}, not {self.served_model_name!r}"
            raise RemoteEngineError(
                f"the engine at {self.base_url} serves {sorted(listed)}, not {self.served_model_name!r}: start it "
                f"with --served-model-name {self.served_model_name} and the same weights as this proxy")
        try:
            for callback in self._on_ready:
                await callback()
        except Exception as error:  # e.g. an adapter it cannot read: it stays out until a later poll succeeds
            logger.exception("remote engine %s could not join", self.base_url)
            self.last_error = f"joining failed: {error!r}"
            return False
        self._state = EngineState.READY
        return True

    async def _watch(self) -> None:
        unhealthy = 0
        while True:
            await asyncio.sleep(self.policy.health_interval_s)
            if self._state is EngineState.FAILED:
                return
            if self._state is EngineState.READY:
                if await self.client.is_healthy(timeout_s=self.policy.health_timeout_s):
                    unhealthy = 0
                    continue
                unhealthy += 1
                logger.warning("remote engine %s health check failed (%d/%d)", self.base_url, unhealthy,
                               self.policy.unhealthy_checks_before_restart)
                if unhealthy >= self.policy.unhealthy_checks_before_restart:
                    unhealthy = 0
                    self._state = EngineState.RESTARTING
                    logger.error("remote engine %s is down; out of rotation until it answers again", self.base_url)
                continue
            try:
                if await self._try_join():
                    self._restarts += 1
                    logger.info("remote engine %s is back (rejoin #%d)", self.base_url, self._restarts)
            except RemoteEngineError:
                logger.exception("remote engine %s came back misconfigured; it stays out", self.base_url)
                return
