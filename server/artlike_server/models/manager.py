"""Which adapter serves which name, and the transactions that change it: register, commit, delete steps.

Names:  `name` → the latest step (an alias), `name@N` → exactly step N, the base model id →
base weights. Every step is loaded into vLLM under its own name `name@N` from its own directory, so
changed weights never reuse an old name (vLLM's prefix cache would serve stale results,
https://github.com/vllm-project/vllm/issues/42125).

Transactions (one at a time per model), each leaving either the old state or the new one:
- `register`: step 0 written, renamed into place, loaded and verified in the engine, then `model.json`
  (the commit point). Any failure removes the model's directory: nothing half-registered remains.
- `commit_step`: the trained step renamed into place as the next free number, loaded, verified, the alias
  moved, then its history line appended (the commit point). Any failure moves the alias back and removes
  the step (best effort; a leftover directory is skipped by numbering and removed at the next start).
- `delete_steps`: the steps stop resolving at once, in-flight requests on them finish (bounded wait, else
  409), then they are unloaded and deleted. The step retention policy runs the same way after each commit.

Requests hold a lease, taken before the adapter is loaded, so an eviction can never unload it between
its load and its use; an adapter is only unloaded when no request holds it. The latest K adapters stay
loaded; older steps load again on demand.

`restore` (after every engine start) restores each model on its own: uncommitted steps are removed, the
newest committed step the engine accepts is served (a refused or corrupt step falls back to the one
before, logged), and a model with no loadable step is left out, logged; the others are served.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from artlike.types import LoraConfig, ModelKind, RewardHeadConfig, StepRetention

from ..engine.client import EngineRequestError
from ..errors import Conflict, InvalidRequest, NotFound, ServiceUnavailable
from .retention import steps_to_delete
from .store import ModelStore, StoredModel, fsync_tree

if TYPE_CHECKING:
    from ..engine.client import AdapterEngine

log = logging.getLogger(__name__)

LEASE_WAIT_SECONDS = 30.0
"""How long deleting a step waits for the requests using it before answering 409."""


@dataclass(frozen=True)
class ServedModel:
    engine_name: str  # the name vLLM knows: the base model id or "name@N"
    model: str | None  # trainable model name, None for the base model
    step: int | None


@dataclass(frozen=True)
class CommittedStep:
    step: int
    adapter_path: Path
    swap_seconds: float


class AdapterRefused(RuntimeError):
    """The engine would not load or list a step's adapter (the step is bad, not the engine)."""


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


def engine_unavailable(error: Exception, what: str) -> ServiceUnavailable:
    """A failed admin call to the engine while serving a request: the client should retry later."""
    return ServiceUnavailable(f"the engine could not {what}: {error}", retry_after=5.0, code="engine_unavailable")


class ModelManager:
    def __init__(
        self,
        store: ModelStore,
        engine: AdapterEngine,
        base_model_id: str,
        *,
        max_loaded: int = 4,
        on_swap: Callable[[float], None] | None = None,
        lease_wait_s: float = LEASE_WAIT_SECONDS,
    ) -> None:
        self.store = store
        self.engine = engine
        self.base_model_id = base_model_id
        self.max_loaded = max(1, max_loaded)
        self.lease_wait_s = lease_wait_s
        self._on_swap = on_swap
        self._latest: dict[str, int] = {}  # alias table: model name → the step `name` serves
        self._newest: dict[str, int] = {}  # model name → newest committed step (`name@N` resolves up to it)
        self._loaded: OrderedDict[str, None] = OrderedDict()  # engine names loaded, least recently used first
        self._locks: dict[str, asyncio.Lock] = {}  # per engine name: one load or unload at a time
        self._model_locks: dict[str, asyncio.Lock] = {}  # per model: one transaction at a time
        self._leases: Counter[str] = Counter()
        self._released = asyncio.Condition()  # notified whenever a lease ends
        self._retiring: set[str] = set()  # engine names being deleted: they no longer resolve
        self._scorers: set[str] = set()  # reward models: their steps resolve but never go to the engine
        self._started = False  # restore() ran once: later runs are engine restarts
        # Called with (model, history line) after each line is committed (the trackers); must not raise.
        self.history_observers: list[Callable[[str, dict[str, Any]], None]] = []
        # Called with (model, step, adapter dir) whenever a model's alias moves (policy engines); must not raise.
        self.alias_observers: list[Callable[[str, int, Path], None]] = []

    # ----------------------------------------------------------------------------- start-up

    async def restore(self) -> None:
        """Load the latest good step of every stored model. Runs after every engine (re)start: a restarted
        vLLM has forgotten all runtime-loaded adapters. Engine outages propagate (the start fails and the
        supervisor retries); a bad step or model only costs that model its step, or its place.

        Only the first call (the process's start) changes files: it removes staging leftovers and
        uncommitted steps of jobs that died with the previous process. Later calls (engine restarts) may
        run while a job of this process is writing or committing a step, so they only load."""
        first = not self._started
        self._started = True
        self._loaded.clear()
        for model in self.store.all():
            if model.kind == "reward":
                self._scorers.add(model.name)
            try:
                async with self._model_lock(model.name):  # not in the middle of a commit of this model
                    await self._restore_model(model.name, clean_up=first)
            except httpx.TransportError:
                raise  # the engine itself is gone (a refused step is handled per step): the start is retried
            except Exception:  # a bug or a broken directory: this model is not served, the others are
                self._latest.pop(model.name, None)
                log.exception("model %r is not served: restoring it failed", model.name)
        log.info("serving %d trainable model(s): %s", len(self._latest),
                 ", ".join(served_name(m, s) for m, s in self._latest.items()) or "-")
        # The policy engines follow the model trained last: announce the restored aliases oldest step first.
        if first:
            for name, step in sorted((item for item in self._latest.items() if item[0] not in self._scorers),
                                     key=lambda item: self.store.step_created_at(*item)):
                self._alias_moved(name, step)

    async def _restore_model(self, name: str, *, clean_up: bool) -> None:
        if clean_up:
            self.store.clear_staging(name)
            for step in self.store.uncommitted_steps(name):
                log.warning("removing step %d of %r: it was never committed (the job stopped before its "
                            "`done`)", step, name)
                self.store.delete_step(name, step)
        committed = self.store.committed_steps(name)
        pinned = self.store.require(name).alias_step
        # The pinned step (a rollback, a held-back step) first; if it cannot be served, the newest that can.
        candidates = ([pinned] if pinned in committed else []) + [s for s in reversed(committed) if s != pinned]
        for step in candidates:
            try:
                await self._ensure_loaded(name, step)
                await self._verify_listed(served_name(name, step))
            except (AdapterRefused, EngineRequestError) as error:  # vLLM answers 500 for a corrupt adapter too
                log.error("step %d of %r cannot be served (%s); falling back to the step before", step, name, error)
                self._loaded.pop(served_name(name, step), None)
                continue
            self._latest[name] = step
            self._newest[name] = max(step, committed[-1]) if step == pinned else step
            if step != committed[-1] and step != pinned:
                log.error("model %r serves step %d: its newer step(s) %s could not be loaded", name, step,
                          [s for s in committed if s > step])
            return
        self._latest.pop(name, None)
        self._newest.pop(name, None)
        log.error("model %r is not served: none of its steps %s could be loaded", name, committed)

    # --------------------------------------------------------------------------- resolution

    def latest_step(self, name: str) -> int | None:
        """The step the alias `name` serves."""
        return self._latest.get(name)

    def newest_step(self, name: str) -> int | None:
        """The newest committed step (above `latest_step` after a rollback or a held-back step)."""
        return self._newest.get(name)

    @property
    def served_models(self) -> list[str]:
        """Names of the trainable models being served (each has a latest step)."""
        return sorted(self._latest)

    def is_loaded(self, name: str, step: int) -> bool:
        return served_name(name, step) in self._loaded

    def is_reward_model(self, name: str) -> bool:
        return name in self._scorers

    def resolve_reward_model(self, requested: str) -> ServedModel:
        """The step of a reward model that `requested` (`name` or `name@N`) names; 4xx when it is none."""
        name, _ = parse_model_reference(requested)
        if name in self._latest and name not in self._scorers:
            raise InvalidRequest(f"model {name!r} is a policy, not a reward model (register one with kind "
                                 "'reward')", param="model", code="not_a_reward_model")
        return self._resolve_step(requested)

    def _resolve_name(self, requested: str) -> ServedModel:
        """What `requested` names, without touching the engine; NotFound for unknown models and steps."""
        if requested == self.base_model_id:
            return ServedModel(self.base_model_id, None, None)
        name, _ = parse_model_reference(requested)
        if name in self._scorers:
            raise InvalidRequest(f"model {name!r} is a reward model: it scores conversations (POST /v1/rewards) "
                                 "and does not generate", param="model", code="reward_model_not_generative")
        return self._resolve_step(requested)

    def _resolve_step(self, requested: str) -> ServedModel:
        name, step = parse_model_reference(requested)
        latest = self._latest.get(name)
        if latest is None:
            raise NotFound(f"model {requested!r} does not exist", param="model", code="model_not_found")
        if step is None:
            step = latest
        elif (step > self._newest.get(name, latest) or served_name(name, step) in self._retiring
              or not (self.store.step_dir(name, step) / "adapter_config.json").is_file()):
            raise NotFound(f"model {name!r} has no step {step} (latest is {latest})", param="model",
                           code="model_not_found")
        return ServedModel(served_name(name, step), name, step)

    async def resolve(self, requested: str) -> ServedModel:
        """Resolve and make sure the adapter is loaded (without holding it: use `lease` to serve)."""
        async with self.lease(requested) as served:
            return served

    @asynccontextmanager
    async def lease(self, requested: str) -> AsyncIterator[ServedModel]:
        """Resolve and hold: the adapter is not unloaded until the block exits. The lease is taken before
        the load, so no eviction can come between the two. Engine failures while loading are 503s."""
        served = self._resolve_name(requested)
        self._leases[served.engine_name] += 1
        try:
            if served.model is not None and served.step is not None:
                try:
                    await self._ensure_loaded(served.model, served.step)
                except (httpx.TransportError, EngineRequestError) as error:
                    raise engine_unavailable(error, f"load adapter {served.engine_name}") from error
            yield served
        finally:
            self._leases[served.engine_name] -= 1
            if self._leases[served.engine_name] <= 0:
                del self._leases[served.engine_name]
            if self._retiring:  # only a delete waits for leases to end; the hot path skips the condition
                async with self._released:
                    self._released.notify_all()

    async def step_logprobs(self, engine_name: str, token_ids: list[int], start: int) -> list[float]:
        """The LoRA engines' logprobs of `token_ids[start:]` under `engine_name` ("name@N" or the base model),
        the adapter loaded and kept so while they are computed (a policy engine's verification)."""
        async with self.lease(engine_name):
            return await self.engine.token_logprobs(engine_name, token_ids, start)

    async def served_model_ids(self) -> list[str]:
        ids = [self.base_model_id]
        for name, latest in sorted(self._latest.items()):
            if name in self._scorers:
                continue  # not generative: /v1/models lists what chat and completions can use
            newest = self._newest.get(name, latest)
            ids.append(name)
            ids.extend(served_name(name, step) for step in self.store.steps(name)
                       if step <= newest and served_name(name, step) not in self._retiring)
        return ids

    # --------------------------------------------------------------------------- transactions

    async def register(
        self,
        name: str,
        base_model: str,
        lora: LoraConfig,
        retention: StepRetention | None,
        write_step0: Callable[[Path], Awaitable[Any]],
        *,
        kind: ModelKind = "policy",
        reward_head: RewardHeadConfig | None = None,
    ) -> tuple[StoredModel, bool]:
        """Create the model (step 0 served, then model.json), or return it when it exists with the same
        LoRA config (a given retention replaces the stored one). Returns (model, created)."""
        async with self._model_lock(name):
            existing = self.store.get(name)
            if existing is not None:
                if (existing.kind, existing.reward_head) != (kind, reward_head):
                    raise Conflict(f"model {name!r} is already registered as a {existing.kind} model"
                                   f"{' with another reward head' if existing.kind == kind else ''}; pick another "
                                   "name or delete it", param="kind", code="model_exists")
                if existing.lora != lora:
                    raise Conflict(
                        f"model {name!r} is already registered with a different LoRA config "
                        f"({existing.lora.model_dump()}); pick another name or delete it",
                        param="lora", code="model_exists")
                if retention is not None and retention != existing.retention:
                    existing = self.store.set_retention(existing, retention)
                return existing, False
            if self.store.model_dir(name).exists():  # a registration that died before model.json
                self.store.delete_model(name)
            try:
                staging = self.store.new_staging_dir(name)
                await write_step0(staging)
                await asyncio.to_thread(fsync_tree, staging)
                self.store.commit_step(name, staging, 0)
                if kind == "reward":
                    self._scorers.add(name)
                await self._publish(name, 0)
                self._newest[name] = 0
                return self.store.create(name, base_model, lora, retention, kind=kind, reward_head=reward_head), True
            except BaseException:
                self._scorers.discard(name)
                self._latest.pop(name, None)
                self._newest.pop(name, None)
                await self._unload_quietly(served_name(name, 0))
                self.store.delete_model(name)
                raise

    async def commit_step(
        self, name: str, staging: Path, history_entry: Callable[[int, float], dict[str, Any]], *,
        load: bool = True, promote: bool = True,
    ) -> CommittedStep:
        """Make a trained adapter directory the model's next step and serve it; `history_entry(step,
        swap_seconds)` is the line whose append commits it. On failure the previous step stays served.
        `load=False` moves the alias without loading the adapter now: its first request loads it.
        `promote=False` loads and verifies the step (`name@N` serves it) but leaves the alias where it is."""
        async with self._model_lock(name):
            previous, previous_newest = self._latest.get(name), self._newest.get(name)
            step = self.store.next_step_number(name)
            await asyncio.to_thread(fsync_tree, staging)
            adapter_path = self.store.commit_step(name, staging, step)
            try:
                if not promote:
                    swap_seconds = await self._load_verified(name, step)
                elif load:
                    swap_seconds = await self._publish(name, step)
                else:
                    self._latest[name], swap_seconds = step, 0.0
                    self._alias_moved(name, step)
                self._newest[name] = step
                # The pin: a held-back step keeps the alias where it was, across restarts too.
                self.store.set_alias_step(name, None if promote else previous)
                entry = history_entry(step, swap_seconds)
                self.store.append_history(name, entry)
            except BaseException:
                await self._roll_back(name, step, previous, previous_newest)
                raise
            self._observe(name, entry)
            await self._apply_retention(name)
            return CommittedStep(step, adapter_path, swap_seconds)

    async def set_alias(self, name: str, step: int, *, reason: str) -> float:
        """Serve committed step `step` under the alias `name` (a rollback, a promotion, a roll forward):
        loaded and verified first, persisted, and recorded in the history. Returns the swap time."""
        async with self._model_lock(name):
            self.store.require(name)
            if step not in self.store.committed_steps(name) or served_name(name, step) in self._retiring:
                raise NotFound(f"model {name!r} has no step {step} to serve", param="step", code="step_not_found")
            previous = self._latest.get(name)
            seconds = await self._publish(name, step)
            newest = self._newest.get(name, step)
            self.store.set_alias_step(name, None if step == newest else step)
            entry = {"event": "alias", "alias_step": step, "previous_step": previous, "time": time.time(),
                     "reason": reason}
            self.store.append_history(name, entry)
            self._observe(name, entry)
            return seconds

    async def record_evaluation(self, name: str, step: int, metrics: dict[str, float], split: str) -> dict[str, Any]:
        """Append an evaluation of committed step `step` to the history (`"event": "eval"`), then apply the
        retention policy again: a `keep_best` rule on `"eval.<metric>"` keeps the best evaluated steps."""
        async with self._model_lock(name):
            self.store.require(name)
            if step not in self.store.committed_steps(name):
                raise NotFound(f"model {name!r} has no committed step {step} to evaluate", param="step",
                               code="step_not_found")
            entry = {"event": "eval", "step": step, "split": split, "eval": dict(metrics), "time": time.time()}
            self.store.append_history(name, entry)
            self._observe(name, entry)
            await self._apply_retention(name)
            return entry

    async def record_event(self, name: str, entry: dict[str, Any]) -> None:
        """Append a history line about the model that commits nothing new (an import's record of step 0)."""
        async with self._model_lock(name):
            self.store.require(name)
            self.store.append_history(name, entry)
            self._observe(name, entry)

    def _observe(self, name: str, entry: dict[str, Any]) -> None:
        for observer in self.history_observers:
            try:
                observer(name, entry)
            except Exception:  # a log writer never fails a committed step
                log.exception("a history observer failed for %r", name)

    async def set_retention(self, name: str, retention: StepRetention) -> StoredModel:
        async with self._model_lock(name):
            model = self.store.set_retention(self.store.require(name), retention)
            await self._apply_retention(name)
            return model

    async def delete_steps(self, name: str, steps: list[int]) -> list[int]:
        """Delete steps (never the latest): they stop resolving now; requests using them finish first (up
        to `lease_wait_s`, else Conflict and nothing is deleted). Returns the steps deleted."""
        async with self._model_lock(name):
            latest = self._latest.get(name)
            doomed = [s for s in steps if s != latest and self.store.step_dir(name, s).is_dir()]
            if self._newest.get(name) in doomed:  # the newest committed step goes: `name@N` stops at the next
                remaining = [s for s in self.store.committed_steps(name) if s not in doomed]
                self._newest[name] = max(remaining, default=latest or 0)
            names = {served_name(name, s) for s in doomed}
            self._retiring |= names
            try:
                await self._wait_unleased(names)
            except TimeoutError:
                busy = sorted(n for n in names if self._leases.get(n))
                self._retiring -= names
                raise Conflict(f"step(s) {', '.join(busy)} are serving requests for more than "
                               f"{self.lease_wait_s:.0f} s; try again later", param="keep",
                               code="step_in_use") from None
            try:
                for step in doomed:
                    await self._delete_step(name, step)
            finally:
                self._retiring -= names
            return doomed

    # ------------------------------------------------------------------------------ internals

    async def publish(self, name: str, step: int) -> float:
        """Load `name@step` (already on disk), verify it and point the alias at it; returns the swap time.
        Prefer the transactions (`register`, `commit_step`), which also commit and roll back."""
        return await self._publish(name, step)

    async def _load_verified(self, name: str, step: int) -> float:
        started = time.perf_counter()
        await self._ensure_loaded(name, step)
        await self._verify_listed(served_name(name, step))
        return time.perf_counter() - started

    async def _publish(self, name: str, step: int) -> float:
        started = time.perf_counter()
        await self._ensure_loaded(name, step)
        await self._verify_listed(served_name(name, step))
        self._latest[name] = step  # the atomic alias move
        self._newest[name] = max(self._newest.get(name, step), step)
        self._alias_moved(name, step)
        await self._evict()
        seconds = time.perf_counter() - started
        if self._on_swap is not None:
            self._on_swap(seconds)
        return seconds

    def _alias_moved(self, name: str, step: int) -> None:
        if name not in self._scorers:
            for observer in self.alias_observers:
                observer(name, step, self.store.step_dir(name, step))

    async def _verify_listed(self, engine_name: str) -> None:
        if parse_model_reference(engine_name)[0] in self._scorers:
            return  # a reward model's steps are scored by the trainer, not served by the engine
        listed = {m.id for m in await self.engine.list_models()}
        if engine_name not in listed:  # never assume an adapter was delivered
            raise AdapterRefused(f"the engine does not list {engine_name} after loading it")

    async def _roll_back(self, name: str, step: int, previous: int | None, previous_newest: int | None) -> None:
        """Undo a commit that failed after the rename. Never raises: the original error is what matters,
        and whatever is left (an engine that was down, a directory) is skipped by numbering and cleaned up
        at the next start."""
        if previous is None:
            self._latest.pop(name, None)
        else:
            self._latest[name] = previous
        if previous_newest is None:
            self._newest.pop(name, None)
        else:
            self._newest[name] = previous_newest
        await self._unload_quietly(served_name(name, step))
        try:
            self.store.delete_step(name, step)
        except OSError as error:
            log.error("rollback of step %d of %r left its directory (%s); it is removed at the next start",
                      step, name, error)

    async def _unload_quietly(self, engine_name: str) -> None:
        try:
            await self._unload(engine_name)
        except (httpx.TransportError, EngineRequestError) as error:
            self._loaded.pop(engine_name, None)
            log.warning("could not unload %s from the engine (%s); a restarted engine will not have it",
                        engine_name, error)

    async def _apply_retention(self, name: str) -> None:
        model = self.store.get(name)
        latest = self._latest.get(name)
        if model is None or latest is None:
            return
        doomed = steps_to_delete(self.store.steps(name), latest, self.store.read_history(name), model.retention,
                                 also_keep={self._newest.get(name, latest)})
        for step in doomed:
            if self._leases.get(served_name(name, step)):
                continue  # in use now: the next commit retires it
            try:
                await self._delete_step(name, step)
                log.info("retention: deleted step %d of %r", step, name)
            except (OSError, httpx.TransportError, EngineRequestError) as error:
                log.error("retention: could not delete step %d of %r (%s)", step, name, error)

    async def _delete_step(self, name: str, step: int) -> None:
        await self._unload(served_name(name, step))
        self.store.delete_step(name, step)

    async def _wait_unleased(self, engine_names: set[str]) -> None:
        async with asyncio.timeout(self.lease_wait_s), self._released:
            await self._released.wait_for(lambda: not any(self._leases.get(n) for n in engine_names))

    async def _unload(self, engine_name: str) -> None:
        async with self._lock(engine_name):
            if engine_name in self._loaded:
                await self.engine.unload_lora_adapter(engine_name)
                del self._loaded[engine_name]

    async def _ensure_loaded(self, name: str, step: int) -> None:
        if name in self._scorers:
            return
        engine_name = served_name(name, step)
        lock = self._lock(engine_name)
        if engine_name in self._loaded and not lock.locked():
            self._loaded.move_to_end(engine_name)
            return
        # One load per name, however many requests ask at once; and a request that finds this name being
        # unloaded waits for the unload to finish, then loads it again (its lease already stops the next one).
        async with lock:
            if engine_name not in self._loaded:
                await self.engine.load_lora_adapter(engine_name, str(self.store.step_dir(name, step)))
                self._loaded[engine_name] = None
                log.info("loaded adapter %s", engine_name)
            self._loaded.move_to_end(engine_name)
        # The adapter just loaded is about to be used (a request, or a publish moving the alias to it).
        await self._evict(keep=engine_name)

    async def _evict(self, keep: str | None = None) -> None:
        pinned = {served_name(m, s) for m, s in self._latest.items()} | {keep}
        for engine_name in list(self._loaded):
            if len(self._loaded) <= self.max_loaded:
                break
            if engine_name in pinned or self._leases.get(engine_name):
                continue
            async with self._lock(engine_name):
                if engine_name in self._loaded and not self._leases.get(engine_name):
                    await self.engine.unload_lora_adapter(engine_name)
                    del self._loaded[engine_name]
                    log.info("unloaded adapter %s (keeping the latest %d)", engine_name, self.max_loaded)

    def _lock(self, engine_name: str) -> asyncio.Lock:
        return self._locks.setdefault(engine_name, asyncio.Lock())

    def _model_lock(self, name: str) -> asyncio.Lock:
        return self._model_locks.setdefault(name, asyncio.Lock())
