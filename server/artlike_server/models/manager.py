"""Which adapter serves which name: resolution, hot-swap and the set of adapters loaded in the engine.

Names (DESIGN §4):  `name` → the latest step (an alias), `name@N` → exactly step N, the base model id →
base weights. Every step is loaded into vLLM under its own name `name@N` from its own directory, so
changed weights never reuse an old name (vLLM's prefix cache would serve stale results, vllm#42125).

A swap loads `name@N+1`, checks the engine lists it, then moves the alias — one dict assignment, so a
request resolves to either the old or the new step, never to something half-loaded. Requests hold a
lease on the adapter they resolved to; an adapter is only unloaded when no request holds it, so a swap
or an eviction never fails a request in flight. The latest K adapters stay loaded; older steps load again
on demand when a request names them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import InvalidRequest, NotFound
from .store import ModelStore

if TYPE_CHECKING:
    from ..engine.client import EngineClient

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServedModel:
    engine_name: str  # the name vLLM knows: the base model id or "name@N"
    model: str | None  # trainable model name, None for the base model
    step: int | None


def served_name(model: str, step: int) -> str:
    return f"{model}@{step}"


def parse_model_reference(requested: str) -> tuple[str, int | None]:
    """'name' → (name, None); 'name@3' → (name, 3). Raises InvalidRequest on a malformed step.

    Only ASCII digits count: `str.isdigit` accepts '²' and other digits `int()` then refuses.
    """
    name, sep, step = requested.partition("@")
    if not sep:
        return name, None
    if not (step.isascii() and step.isdigit()):
        raise InvalidRequest(f"model {requested!r} is malformed: the step after '@' must be a number "
                             f"(e.g. {name}@3)", param="model", code="invalid_model_reference")
    return name, int(step)


class ModelManager:
    def __init__(
        self,
        store: ModelStore,
        engine: EngineClient,
        base_model_id: str,
        *,
        max_loaded: int = 4,
        on_swap: Callable[[float], None] | None = None,
    ) -> None:
        self.store = store
        self.engine = engine
        self.base_model_id = base_model_id
        self.max_loaded = max(1, max_loaded)
        self._on_swap = on_swap
        self._latest: dict[str, int] = {}  # alias table: model name → latest step
        self._loaded: OrderedDict[str, None] = OrderedDict()  # engine names loaded, least recently used first
        self._locks: dict[str, asyncio.Lock] = {}
        self._leases: Counter[str] = Counter()

    # ----------------------------------------------------------------------------- start-up

    async def restore(self) -> None:
        """Load the latest step of every stored model. Runs after every engine (re)start: a restarted
        vLLM has forgotten all runtime-loaded adapters."""
        self._loaded.clear()
        for model in self.store.all():
            self.store.clear_staging(model.name)
            latest = self.store.latest_step(model.name)
            if latest is None:
                continue
            self._latest[model.name] = latest
            await self._ensure_loaded(model.name, latest)
        log.info("serving %d trainable model(s): %s", len(self._latest),
                 ", ".join(served_name(m, s) for m, s in self._latest.items()) or "-")

    # --------------------------------------------------------------------------- resolution

    def latest_step(self, name: str) -> int | None:
        return self._latest.get(name)

    @property
    def served_models(self) -> list[str]:
        """Names of the trainable models being served (each has a latest step)."""
        return sorted(self._latest)

    def is_loaded(self, name: str, step: int) -> bool:
        return served_name(name, step) in self._loaded

    async def resolve(self, requested: str) -> ServedModel:
        if requested == self.base_model_id:
            return ServedModel(self.base_model_id, None, None)
        name, step = parse_model_reference(requested)
        latest = self._latest.get(name)
        if latest is None:
            raise NotFound(f"model {requested!r} does not exist", param="model", code="model_not_found")
        if step is None:
            step = latest
        elif step > latest or not self.store.step_dir(name, step).is_dir():
            raise NotFound(f"model {name!r} has no step {step} (latest is {latest})", param="model",
                           code="model_not_found")
        await self._ensure_loaded(name, step)
        return ServedModel(served_name(name, step), name, step)

    @asynccontextmanager
    async def lease(self, requested: str) -> AsyncIterator[ServedModel]:
        """Resolve and hold: the adapter is not unloaded until the block exits."""
        served = await self.resolve(requested)
        self._leases[served.engine_name] += 1
        try:
            yield served
        finally:
            self._leases[served.engine_name] -= 1
            if self._leases[served.engine_name] <= 0:
                del self._leases[served.engine_name]

    async def served_model_ids(self) -> list[str]:
        ids = [self.base_model_id]
        for name, latest in sorted(self._latest.items()):
            ids.append(name)
            ids.extend(served_name(name, step) for step in self.store.steps(name) if step <= latest)
        return ids

    # ------------------------------------------------------------------------------ swapping

    async def publish(self, name: str, step: int) -> float:
        """Load `name@step` into the engine and point the alias at it. Returns the swap time in seconds."""
        started = time.perf_counter()
        await self._ensure_loaded(name, step)
        engine_name = served_name(name, step)
        listed = {m.id for m in await self.engine.list_models()}
        if engine_name not in listed:  # DESIGN §9: never assume an adapter was delivered
            raise RuntimeError(f"the engine does not list {engine_name} after loading it")
        self._latest[name] = step  # the atomic alias move
        await self._evict()
        seconds = time.perf_counter() - started
        if self._on_swap is not None:
            self._on_swap(seconds)
        return seconds

    async def forget_step(self, name: str, step: int) -> None:
        """Unload a step that is about to be deleted (never the latest)."""
        engine_name = served_name(name, step)
        async with self._lock(engine_name):
            if engine_name in self._loaded:
                await self.engine.unload_lora_adapter(engine_name)
                del self._loaded[engine_name]

    async def _ensure_loaded(self, name: str, step: int) -> None:
        engine_name = served_name(name, step)
        if engine_name in self._loaded:
            self._loaded.move_to_end(engine_name)
            return
        async with self._lock(engine_name):  # one load per name, however many requests ask at once
            if engine_name not in self._loaded:
                await self.engine.load_lora_adapter(engine_name, str(self.store.step_dir(name, step)))
                self._loaded[engine_name] = None
                log.info("loaded adapter %s", engine_name)
            self._loaded.move_to_end(engine_name)
        # The adapter just loaded is about to be used (a request, or a publish moving the alias to it).
        await self._evict(keep=engine_name)

    async def _evict(self, keep: str | None = None) -> None:
        pinned = {served_name(m, s) for m, s in self._latest.items()} | set(self._leases) | {keep}
        for engine_name in list(self._loaded):
            if len(self._loaded) <= self.max_loaded:
                break
            if engine_name in pinned:
                continue
            async with self._lock(engine_name):
                if engine_name in self._loaded and engine_name not in self._leases:
                    await self.engine.unload_lora_adapter(engine_name)
                    del self._loaded[engine_name]
                    log.info("unloaded adapter %s (keeping the latest %d)", engine_name, self.max_loaded)

    def _lock(self, engine_name: str) -> asyncio.Lock:
        return self._locks.setdefault(engine_name, asyncio.Lock())
