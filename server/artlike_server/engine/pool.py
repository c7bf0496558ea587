"""Several vLLM engines behind one proxy: routing, failover, and every engine on the same adapters.

    EnginePool
      members: EngineMember (id "local-0", "remote-0", ...; a runner + an EngineClient + load counters)
        runner: EngineSupervisor (a child process this server starts) | RemoteEngine (someone else's)
      post(path, body, affinity=, replayable=)   the proxy's hot path (routing.py picks the engine)
      load_lora_adapter / unload_lora_adapter / list_models / token_logprobs   what ModelManager and the
                                                                                 studio guard call

Consistency (never serve mixed steps):
- An engine takes traffic only while its runner is READY and it has *joined*: its adapters are exactly
  the pool's `desired` set (what every serving engine has loaded). Joining runs as the runner's on_ready
  callback, so after every (re)start: it unloads adapters it should not have, loads the missing ones and
  checks `/v1/models` lists them, all under the pool's admin lock, so no load can slip past a joining
  engine. When no engine serves (the first start, or all were down) there is nothing to copy from: the
  pool's own on_ready callbacks run instead (ModelManager.restore loads from the adapter store).
- A load goes to every engine that serves or is joining, and is verified on each; if any engine
  refuses, it is unloaded again from the others and the error is raised (the swap fails loudly, the
  alias does not move). An engine that cannot be reached during a load or unload leaves the rotation
  (it rejoins, with a full replay, as soon as it answers); the swap goes on with the others.
- A background loop retries joining engines whose runner is READY but which are out (a failed join,
  a missed load), and audits serving engines' adapter lists, so a remote engine that restarted between
  two health checks (and forgot its adapters) is noticed and replayed.

Failover: a request whose engine cannot be reached, or (non-streaming only: `replayable`) whose answer
breaks off, is sent again to another engine; that engine is avoided for `cooldown_s`. A stream that
has started is never re-sent: its client has seen tokens from the first engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from .client import EngineClient, EngineModel, EngineRequestError
from .policy import PolicyEngines
from .routing import AffinityTable, Load, Phase, choose, least_loaded, spill_to_lora
from .supervisor import EngineState, OnReady
from .upstream import EngineAnswer, EngineConnectionError, UpstreamResponse

logger = logging.getLogger(__name__)
MAX_START_BACKOFF_S = 600.0  # the longest wait between two tries to start an engine whose start failed

_STATE_ORDER = (EngineState.READY, EngineState.STARTING, EngineState.RESTARTING, EngineState.FAILED,
                EngineState.STOPPED)


class EngineRunner(Protocol):
    """What the pool needs of an engine's keeper (EngineSupervisor or RemoteEngine)."""

    @property
    def state(self) -> EngineState: ...

    @property
    def restarts(self) -> int: ...

    @property
    def pid(self) -> int | None: ...

    def retry_after(self) -> float: ...

    def add_on_ready(self, callback: OnReady) -> None: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class NoEngineServing(httpx.TransportError):
    """No engine is in the rotation (admin calls fail as if the engine were unreachable)."""


@dataclass(eq=False)
class EngineMember:
    id: str  # "local-0", "remote-1": stable for the process's life; a label in /health and /metrics
    kind: str  # "local" | "remote"
    runner: EngineRunner
    client: EngineClient
    phase: Phase = Phase.OUT
    load: Load = field(default_factory=lambda: Load(""))
    failures: int = 0  # requests that could not be completed on this engine (then sent elsewhere)
    avoid_until: float = 0.0  # monotonic time: skipped by the router until then (it just failed a request)
    next_join: float = 0.0  # monotonic time of the next rejoin attempt while out
    start_failures: int = 0  # consecutive failed starts (the retry backoff doubles with each)
    next_start: float = 0.0  # monotonic time of the next start attempt while its runner is FAILED
    starting: asyncio.Task[None] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.load.id = self.id

    @property
    def url(self) -> str:
        return self.client.base_url

    @property
    def in_rotation(self) -> bool:
        return self.phase is Phase.SERVING and self.runner.state is EngineState.READY

    def describe(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind, "url": self.url, "state": str(self.runner.state),
                "phase": str(self.phase), "serving": self.in_rotation, "outstanding": self.load.outstanding,
                "requests": self.load.served, "failures": self.failures, "restarts": self.runner.restarts,
                "pid": self.runner.pid}


class BufferedResponse:
    """An engine answer already read whole (what a replayable request returns)."""

    def __init__(self, status: int, content: bytes) -> None:
        self.status = status
        self._content = content

    async def read(self) -> bytes:
        return self._content

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        yield self._content

    def abort(self) -> None:
        return None


class TrackedResponse:
    """A streamed engine answer; `done` runs once when its body has ended, broken off or been aborted."""

    def __init__(self, response: UpstreamResponse, done: Callable[[], None]) -> None:
        self._response = response
        self._done: Callable[[], None] | None = done

    @property
    def status(self) -> int:
        return self._response.status

    async def read(self) -> bytes:
        try:
            return await self._response.read()
        finally:
            self._finish()

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.iter_chunks():
                yield chunk
        finally:
            self._finish()

    def abort(self) -> None:
        self._response.abort()
        self._finish()

    def _finish(self) -> None:
        if self._done is not None:
            done, self._done = self._done, None
            done()



class EnginePool:
    def __init__(self, members: Sequence[EngineMember], *, cooldown_s: float = 5.0, maintenance_s: float = 5.0,
                 audit_every_s: float = 15.0, rejoin_backoff_s: float = 30.0, max_affinity_keys: int = 100_000,
                 policy: PolicyEngines | None = None) -> None:
        if not members:
            raise ValueError("an engine pool needs at least one engine")
        ids = [member.id for member in members]
        if len(set(ids)) != len(ids):
            raise ValueError(f"engine ids must be unique: {ids}")
        self.members = list(members)  # LoRA engines: every adapter, the base model; admin calls go here
        self.policy = policy  # merged-weights engines for the training policy (policy.py), routed first
        self.cooldown_s = cooldown_s
        self.maintenance_s = maintenance_s
        self.audit_every_s = audit_every_s
        self.rejoin_backoff_s = rejoin_backoff_s
        self._affinity = AffinityTable(max_affinity_keys)
        self._desired: dict[str, str] = {}  # adapter name -> path: what every serving engine has loaded
        self._admin = asyncio.Lock()  # loads, unloads and joins: one at a time across the pool
        self._join_lock = asyncio.Lock()  # joins one at a time (the first one may restore from the store)
        self._on_ready: list[OnReady] = []
        self._maintenance: asyncio.Task[None] | None = None
        self._policy_start: asyncio.Task[None] | None = None
        self._last_audit = 0.0
        for member in self.members:
            member.runner.add_on_ready(self._joiner(member))

    # ----------------------------------------------------------------------------------- state

    @property
    def state(self) -> EngineState:
        """READY while any engine serves; else the most hopeful of the runners' states."""
        if any(member.in_rotation for member in self.members):
            return EngineState.READY
        states = {member.runner.state for member in self.members}
        if EngineState.READY in states:  # up but not joined (yet): as good as restarting for a client
            return EngineState.RESTARTING
        return next(state for state in _STATE_ORDER if state in states)

    @property
    def restarts(self) -> int:
        return sum(member.runner.restarts for member in self.members)

    @property
    def pid(self) -> int | None:
        """The first local engine's pid (None when there is none or it is down)."""
        return next((m.runner.pid for m in self.members if m.kind == "local" and m.runner.pid is not None), None)

    def retry_after(self) -> float:
        return 0.0 if self.state is EngineState.READY else min(m.runner.retry_after() for m in self.members)

    def describe(self) -> list[dict[str, Any]]:
        policy = self.policy.describe() if self.policy is not None else []
        return [member.describe() for member in self.members] + policy

    def add_on_ready(self, callback: OnReady) -> None:
        """Run `callback` whenever an engine joins while no engine serves (ModelManager.restore)."""
        self._on_ready.append(callback)

    # ------------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Start every engine (at once); returns when each start has succeeded or failed. Raises the
        first start's error only when no engine started: the others serve, the failures are logged."""
        if self.policy is not None:  # policy engines start beside the others; one that fails only logs
            self._policy_start = asyncio.create_task(self._start_policy(self.policy), name="artlike-policy-start")
        results = await asyncio.gather(*(member.runner.start() for member in self.members), return_exceptions=True)
        errors = [(member, result) for member, result in zip(self.members, results, strict=True)
                  if isinstance(result, BaseException)]
        for member, error in errors:
            self._start_failed(member, error)
        if len(errors) == len(self.members):
            raise errors[0][1]
        self._maintenance = asyncio.create_task(self._maintain(), name="artlike-engine-pool")

    async def _start_policy(self, policy: PolicyEngines) -> None:
        results = await asyncio.gather(*(member.runner.start() for member in policy.members), return_exceptions=True)
        for member, result in zip(policy.members, results, strict=True):
            if isinstance(result, BaseException):
                self._start_failed(member, result)

    def _start_failed(self, member: EngineMember, error: BaseException) -> None:
        """A start failed (a warm-up that timed out on a crowded machine, a remote engine not up yet): the
        maintenance loop tries again, after 30 s, 60 s, 120 s... (at most 10 min apart)."""
        member.start_failures += 1
        delay = min(self.rejoin_backoff_s * 2 ** (member.start_failures - 1), MAX_START_BACKOFF_S)
        member.next_start = time.monotonic() + delay
        logger.error("engine %s (%s) did not start (%s); next try in %.0f s", member.id, member.url, error, delay)

    def _retry_failed_starts(self, now: float) -> None:
        policy_members = self.policy.members if self.policy is not None else []
        for member in [*self.members, *policy_members]:
            idle = member.starting is None or member.starting.done()
            if member.runner.state is EngineState.FAILED and idle and now >= member.next_start:
                member.starting = asyncio.create_task(self._retry_start(member), name=f"artlike-start-{member.id}")

    async def _retry_start(self, member: EngineMember) -> None:
        logger.info("engine %s (%s): starting again", member.id, member.url)
        try:
            await member.runner.start()  # joins through its on-ready callback, as at the first start
        except Exception as error:
            self._start_failed(member, error)
        else:
            member.start_failures = 0

    async def stop(self) -> None:
        everyone = list(self.members)
        if self.policy is not None:
            everyone += self.policy.members
            if self._policy_start is not None:
                self._policy_start.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._policy_start
            await self.policy.stop()
        if self._maintenance is not None:
            self._maintenance.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._maintenance
        for member in everyone:
            if member.starting is not None:
                member.starting.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await member.starting
        await asyncio.gather(*(member.runner.stop() for member in everyone), return_exceptions=True)
        await asyncio.gather(*(member.client.aclose() for member in everyone), return_exceptions=True)

    # ------------------------------------------------------------------------------- the hot path

    async def post(self, path: str, body: bytes, *, affinity: str | None = None,
                   replayable: bool = False, model: str | None = None) -> EngineAnswer:
        """Send `body` to one engine's `path`. `affinity`: keep requests with this key on one engine.
        `replayable`: the caller wants the whole body (not a stream), so an answer that breaks off is
        sent again elsewhere; the returned response is then already read. `model`: the engine model name
        in `body`; a policy engine holding exactly that step (or the base model) is tried first."""
        tried: set[str] = set()
        last_error: EngineConnectionError | None = None
        while (chosen := self._route(model, affinity, exclude=tried)) is not None:
            member, send = chosen
            tried.add(member.id)
            member.load.outstanding += 1
            member.load.served += 1
            try:
                response = await member.client.upstream.post(path, send(body))
                if not replayable:
                    return TrackedResponse(response, functools.partial(self._release, member))
                content = await response.read()
            except EngineConnectionError as error:
                self._release(member)
                self._failed(member, error)
                last_error = error
                continue
            except BaseException:
                self._release(member)
                raise
            self._release(member)
            return BufferedResponse(response.status, content)
        if last_error is not None:
            raise last_error
        raise EngineConnectionError("no engine is serving")

    def _route(self, model: str | None, affinity: str | None, *,
               exclude: set[str]) -> tuple[EngineMember, Callable[[bytes], bytes]] | None:
        if (model is not None and self.policy is not None
                and (member := self.policy.pick(model, exclude=exclude)) is not None):
            least_busy = least_loaded([m.load for m in self.members if m.in_rotation and m.id not in exclude])
            if not spill_to_lora(member.load, least_busy):
                return member, self.policy.rebase if model != self.policy.base_model_id else _unchanged
        lora = self._pick(affinity, exclude=exclude)
        return None if lora is None else (lora, _unchanged)

    def _pick(self, affinity: str | None, *, exclude: set[str]) -> EngineMember | None:
        serving = [m for m in self.members if m.in_rotation and m.id not in exclude]
        now = time.monotonic()
        candidates = [m for m in serving if m.avoid_until <= now] or serving
        load = choose([m.load for m in candidates], self._affinity, affinity)
        return None if load is None else next(m for m in candidates if m.load is load)

    def _release(self, member: EngineMember) -> None:
        member.load.outstanding -= 1

    def _failed(self, member: EngineMember, error: Exception) -> None:
        member.failures += 1
        member.avoid_until = time.monotonic() + self.cooldown_s
        self._affinity.forget_engine(member.id)
        logger.warning("engine %s failed a request (%s); trying another", member.id, error)

    # ------------------------------------------------------------------------------- admin calls

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Load `name` on every engine that serves or is joining, verified on each (`/v1/models`)."""
        async with self._admin:
            targets = self._admin_targets()
            if not targets:
                raise NoEngineServing("no engine is serving")
            results = await asyncio.gather(*(self._load_verified(m, name, path) for m in targets),
                                           return_exceptions=True)
            refused = [r for r in results if isinstance(r, BaseException) and not _unreachable(r)]
            loaded = [m for m, r in zip(targets, results, strict=True) if not isinstance(r, BaseException)]
            for member, result in zip(targets, results, strict=True):
                if isinstance(result, BaseException) and _unreachable(result):
                    self._drop(member, f"unreachable while loading {name} ({result!r})")
            if refused or not loaded:
                await asyncio.gather(*(m.client.unload_lora_adapter(name) for m in loaded), return_exceptions=True)
                error = (refused or [r for r in results if isinstance(r, BaseException)])[0]
                assert isinstance(error, BaseException)
                raise error
            self._desired[name] = path

    async def unload_lora_adapter(self, name: str) -> None:
        async with self._admin:
            self._desired.pop(name, None)
            targets = self._admin_targets()
            results = await asyncio.gather(*(m.client.unload_lora_adapter(name) for m in targets),
                                           return_exceptions=True)
            for member, result in zip(targets, results, strict=True):
                if isinstance(result, BaseException):
                    # Unreachable, or it already lacked the adapter: either way its set is unknown now,
                    # so it replays the pool's set before it serves again.
                    self._drop(member, f"unloading {name} failed ({result!r})")
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors and len(errors) == len(results):
                raise errors[0]

    async def list_models(self) -> list[EngineModel]:
        """The models every serving (or joining) engine lists: an adapter counts once all have it."""
        targets = self._admin_targets()
        if not targets:
            raise NoEngineServing("no engine is serving")
        lists = await asyncio.gather(*(m.client.list_models() for m in targets))
        common = set.intersection(*({model.id for model in listed} for listed in lists))
        return [model for model in lists[0] if model.id in common]

    async def token_logprobs(self, model: str, token_ids: list[int], start: int) -> list[float]:
        member = self._pick(None, exclude=set())
        if member is None:
            raise NoEngineServing("no engine is serving")
        return await member.client.token_logprobs(model, token_ids, start)

    def _admin_targets(self) -> list[EngineMember]:
        return [m for m in self.members if m.phase is Phase.JOINING or m.in_rotation]

    async def _load_verified(self, member: EngineMember, name: str, path: str) -> None:
        await member.client.load_lora_adapter(name, path)
        if name not in {model.id for model in await member.client.list_models()}:
            raise EngineRequestError("GET", "/v1/models", 200, f"{member.id} does not list {name} after loading it")

    def _drop(self, member: EngineMember, reason: str) -> None:
        if member.phase is not Phase.OUT:
            logger.error("engine %s leaves the rotation: %s; it rejoins with a full replay", member.id, reason)
        member.phase = Phase.OUT
        self._affinity.forget_engine(member.id)

    # ------------------------------------------------------------------------------- joining

    def _joiner(self, member: EngineMember) -> Callable[[], Awaitable[None]]:
        async def join() -> None:
            await self._join(member)

        return join

    async def _join(self, member: EngineMember) -> None:
        async with self._join_lock:
            member.phase = Phase.JOINING
            self._affinity.forget_engine(member.id)  # a (re)started engine has an empty prefix cache
            try:
                if any(other.in_rotation for other in self.members if other is not member):
                    async with self._admin:
                        await self._replay(member)
                else:  # nothing to copy from: restore from the store, loading onto every joining engine
                    self._desired.clear()
                    for callback in self._on_ready:
                        await callback()
            except BaseException:
                member.phase = Phase.OUT
                member.next_join = time.monotonic() + self.rejoin_backoff_s
                raise
            if member.phase is not Phase.JOINING:  # a load during the join could not reach it
                member.next_join = time.monotonic() + self.rejoin_backoff_s
                raise NoEngineServing(f"engine {member.id} became unreachable while joining")
            member.phase = Phase.SERVING
            logger.info("engine %s (%s) serves (%d adapters)", member.id, member.url, len(self._desired))

    async def _replay(self, member: EngineMember) -> None:
        """Make `member`'s adapters exactly the pool's set (caller holds the admin lock)."""
        listed = {model.id: model for model in await member.client.list_models()}
        for name, model in listed.items():
            if model.parent is not None and name not in self._desired:
                await member.client.unload_lora_adapter(name)
        for name, path in self._desired.items():
            if name not in listed:
                await member.client.load_lora_adapter(name, path)
        now_listed = {model.id for model in await member.client.list_models()}
        if missing := set(self._desired) - now_listed:
            raise EngineRequestError("GET", "/v1/models", 200, f"{member.id} does not list {sorted(missing)}")

    async def _maintain(self) -> None:
        while True:
            await asyncio.sleep(self.maintenance_s)
            try:
                await self._maintain_once()
            except Exception:  # a bug here must not stop the pool from healing
                logger.exception("engine pool maintenance failed")

    async def _maintain_once(self) -> None:
        if self.policy is not None:
            self.policy.kick()
        now = time.monotonic()
        self._retry_failed_starts(now)
        for member in self.members:
            if member.phase is Phase.OUT and member.runner.state is EngineState.READY and now >= member.next_join:
                try:
                    await self._join(member)
                except Exception as error:
                    logger.error("engine %s could not rejoin (%r); next try in %.0f s", member.id, error,
                                 self.rejoin_backoff_s)
        if now - self._last_audit < self.audit_every_s:
            return
        self._last_audit = now
        for member in [m for m in self.members if m.in_rotation]:
            async with self._admin:
                try:
                    listed = {model.id for model in await member.client.list_models()}
                except (httpx.TransportError, EngineRequestError):
                    continue  # the runner's health checks decide about an engine that does not answer
                if missing := set(self._desired) - listed:
                    self._drop(member, f"it lost adapters {sorted(missing)} (restarted?)")


def _unchanged(body: bytes) -> bytes:
    return body


def _unreachable(error: BaseException) -> bool:
    return isinstance(error, (httpx.TransportError, EngineConnectionError))
