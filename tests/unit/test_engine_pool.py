"""The engine pool's consistency and failover rules (engine/pool.py), with in-process stand-ins for the
engines: what an engine lists, loads and answers is scripted, the pool's logic is the real one. The
integration test (tests/integration/test_scale_out.py) runs the same rules against real vLLM engines."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from artlike_server.engine.client import EngineModel, EngineRequestError
from artlike_server.engine.pool import EngineMember, EnginePool, NoEngineServing, Phase
from artlike_server.engine.supervisor import EngineState, OnReady
from artlike_server.engine.upstream import EngineConnectionError

BASE = "base"


class FakeRunner:
    def __init__(self, fail_start: bool = False) -> None:
        self.state = EngineState.STOPPED
        self.restarts = 0
        self.pid: int | None = None
        self.fail_start = fail_start
        self._on_ready: list[OnReady] = []

    def retry_after(self) -> float:
        return 0.0 if self.state is EngineState.READY else 3.0

    def add_on_ready(self, callback: OnReady) -> None:
        self._on_ready.append(callback)

    async def start(self) -> None:
        self.state = EngineState.STARTING
        if self.fail_start:
            self.state = EngineState.FAILED
            raise EngineConnectionError("cannot start")
        for callback in self._on_ready:
            await callback()
        self.state = EngineState.READY

    async def restart(self) -> None:
        """As the supervisor does after a crash: a failing callback is logged and the engine is READY."""
        self.state = EngineState.RESTARTING
        self.restarts += 1
        for callback in self._on_ready:
            with contextlib.suppress(Exception):
                await callback()
        self.state = EngineState.READY

    async def stop(self) -> None:
        self.state = EngineState.STOPPED


class FakeAnswer:
    def __init__(self, engine: str, fail_body: bool) -> None:
        self.status = 200
        self.engine = engine
        self.fail_body = fail_body
        self.aborted = False

    async def read(self) -> bytes:
        if self.fail_body:
            raise EngineConnectionError("broke off")
        return self.engine.encode()

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        yield self.engine.encode()

    def abort(self) -> None:
        self.aborted = True


class FakeUpstream:
    def __init__(self, client: FakeClient) -> None:
        self.client = client

    async def post(self, path: str, body: bytes) -> FakeAnswer:
        if self.client.unreachable:
            raise EngineConnectionError("connection refused")
        self.client.posts += 1
        await asyncio.sleep(0)
        return FakeAnswer(self.client.base_url, self.client.break_bodies)


class FakeClient:
    def __init__(self, name: str) -> None:
        self.base_url = name
        self.loaded: dict[str, str] = {}
        self.refuse: set[str] = set()
        self.unreachable = False
        self.break_bodies = False
        self.posts = 0
        self.upstream = FakeUpstream(self)

    def _check(self) -> None:
        if self.unreachable:
            raise httpx.ConnectError("refused")

    async def load_lora_adapter(self, name: str, path: str) -> None:
        self._check()
        if name in self.refuse:
            raise EngineRequestError("POST", "/v1/load_lora_adapter", 400, f"cannot load {name}")
        self.loaded[name] = path

    async def unload_lora_adapter(self, name: str) -> None:
        self._check()
        if self.loaded.pop(name, None) is None:
            raise EngineRequestError("POST", "/v1/unload_lora_adapter", 404, f"no {name}")

    async def list_models(self) -> list[EngineModel]:
        self._check()
        return [EngineModel(id=BASE)] + [EngineModel(id=n, root=p, parent=BASE) for n, p in self.loaded.items()]

    async def token_logprobs(self, model: str, token_ids: list[int], start: int) -> list[float]:
        return [0.0]

    async def aclose(self) -> None:
        return None


def make_pool(count: int = 2, **kwargs: Any) -> tuple[EnginePool, list[FakeRunner], list[FakeClient]]:
    runners = [FakeRunner() for _ in range(count)]
    clients = [FakeClient(f"e{i}") for i in range(count)]
    members = [EngineMember(id=f"local-{i}", kind="local", runner=r, client=c)  # type: ignore[arg-type]
               for i, (r, c) in enumerate(zip(runners, clients, strict=True))]
    return EnginePool(members, **kwargs), runners, clients


def restore_into(pool: EnginePool, adapters: dict[str, str]) -> list[int]:
    """What ModelManager.restore does: load the stored adapters through the pool; counts its calls."""
    calls: list[int] = []

    async def restore() -> None:
        calls.append(1)
        for name, path in adapters.items():
            await pool.load_lora_adapter(name, path)

    pool.add_on_ready(restore)
    return calls


async def test_the_first_engine_restores_from_the_store_and_the_next_copies_it() -> None:
    pool, _runners, clients = make_pool(2)
    calls = restore_into(pool, {"m@3": "/store/m/3"})
    await pool.start()
    assert calls == [1]  # restored once; the second engine replayed the first one's set
    assert [c.loaded for c in clients] == [{"m@3": "/store/m/3"}] * 2
    assert pool.state is EngineState.READY and all(m.in_rotation for m in pool.members)
    await pool.stop()


async def test_a_load_reaches_every_engine_or_none() -> None:
    pool, _, clients = make_pool(2)
    await pool.start()
    await pool.load_lora_adapter("m@1", "/p1")
    assert [c.loaded for c in clients] == [{"m@1": "/p1"}] * 2
    assert {m.id for m in await pool.list_models()} == {BASE, "m@1"}

    clients[1].refuse.add("m@2")  # e.g. a remote engine that cannot read the adapter's path
    with pytest.raises(EngineRequestError, match="cannot load m@2"):
        await pool.load_lora_adapter("m@2", "/p2")
    assert [c.loaded for c in clients] == [{"m@1": "/p1"}] * 2  # taken back from the engine that had it
    assert all(m.in_rotation for m in pool.members)  # a refusal is the step's fault, not the engine's
    await pool.stop()


async def test_an_unreachable_engine_leaves_the_rotation_and_rejoins_with_everything() -> None:
    pool, _runners, clients = make_pool(2, rejoin_backoff_s=0.0)
    await pool.start()
    clients[1].unreachable = True
    await pool.load_lora_adapter("m@1", "/p1")  # the swap goes on with the engine that answers
    assert clients[0].loaded == {"m@1": "/p1"} and clients[1].loaded == {}
    assert pool.members[1].phase is Phase.OUT and not pool.members[1].in_rotation
    await pool.unload_lora_adapter("m@1")
    await pool.load_lora_adapter("m@2", "/p2")

    clients[1].loaded = {"stale@9": "/old"}  # it kept an adapter the pool has unloaded since
    clients[1].unreachable = False
    await pool._maintain_once()  # the pool's background loop, once
    assert clients[1].loaded == {"m@2": "/p2"} and pool.members[1].in_rotation
    await pool.stop()


async def test_a_restarted_engine_gets_the_kept_adapters_before_it_takes_traffic() -> None:
    pool, runners, clients = make_pool(2)
    restore_into(pool, {})
    await pool.start()
    await pool.load_lora_adapter("m@1", "/p1")
    await pool.load_lora_adapter("m@2", "/p2")
    clients[0].loaded.clear()  # vLLM forgets runtime-loaded adapters when it restarts
    seen_during_join: list[bool] = []
    runners[0].add_on_ready(lambda: _note(seen_during_join, pool.members[0].in_rotation))
    await runners[0].restart()
    assert clients[0].loaded == {"m@1": "/p1", "m@2": "/p2"}
    assert seen_during_join == [False] and pool.members[0].in_rotation
    await pool.stop()


async def _note(seen: list[bool], value: bool) -> None:
    seen.append(value)


async def test_when_every_engine_was_down_the_store_is_restored_again() -> None:
    pool, runners, clients = make_pool(1)
    calls = restore_into(pool, {"m@4": "/p4"})
    await pool.start()
    clients[0].loaded.clear()
    await runners[0].restart()  # no other engine to copy from
    assert calls == [1, 1] and clients[0].loaded == {"m@4": "/p4"}
    await pool.stop()


async def test_requests_spread_and_fail_over_to_a_healthy_engine() -> None:
    pool, _, clients = make_pool(2, cooldown_s=60.0)
    await pool.start()
    answers = await asyncio.gather(*(pool.post("/v1/completions", b"{}", replayable=True) for _ in range(4)))
    assert sorted([await a.read() for a in answers]) == [b"e0", b"e0", b"e1", b"e1"]

    clients[0].unreachable = True
    answers = [await pool.post("/v1/completions", b"{}", replayable=True) for _ in range(3)]
    assert [await a.read() for a in answers] == [b"e1"] * 3
    assert pool.members[0].failures == 1  # tried once, then avoided during its cool-down

    clients[0].unreachable = False
    clients[1].break_bodies = True  # answers start, then break off: a non-streamed request is sent again
    pool.members[0].avoid_until = 0.0
    assert await (await pool.post("/v1/completions", b"{}", replayable=True)).read() == b"e0"
    assert [m.load.outstanding for m in pool.members] == [0, 0]
    await pool.stop()


async def test_a_stream_is_counted_until_it_ends_and_is_never_sent_twice() -> None:
    pool, _, clients = make_pool(2)
    await pool.start()
    stream = await pool.post("/v1/chat/completions", b"{}", affinity="traj-1")
    owner = next(m for m in pool.members if m.load.outstanding == 1)
    assert [chunk async for chunk in stream.iter_chunks()] == [owner.url.encode()]
    assert owner.load.outstanding == 0
    # The trajectory's next turns go to the same engine.
    for _ in range(3):
        answer = await pool.post("/v1/chat/completions", b"{}", affinity="traj-1")
        answer.abort()
    assert owner.load.served == 4 and owner.load.outstanding == 0

    clients[0].break_bodies = clients[1].break_bodies = True
    broken = await pool.post("/v1/chat/completions", b"{}")  # a stream: handed over, not re-sent
    with pytest.raises(EngineConnectionError):
        await broken.read()
    assert sum(c.posts for c in clients) == 5
    await pool.stop()


async def test_no_engine_serving_is_an_unreachable_engine_for_every_caller() -> None:
    pool, _runners, clients = make_pool(2)
    for client in clients:
        client.unreachable = True
    assert pool.state is EngineState.STOPPED
    with pytest.raises(EngineConnectionError, match="no engine is serving"):
        await pool.post("/v1/completions", b"{}")
    with pytest.raises(NoEngineServing):
        await pool.load_lora_adapter("m@1", "/p")
    with pytest.raises(NoEngineServing):
        await pool.list_models()


async def test_the_pool_serves_when_one_engine_fails_to_start_and_fails_when_all_do() -> None:
    pool, runners, _ = make_pool(2)
    runners[1].fail_start = True
    await pool.start()
    assert pool.state is EngineState.READY and [m.in_rotation for m in pool.members] == [True, False]
    await pool.stop()

    pool, runners, _ = make_pool(2)
    for runner in runners:
        runner.fail_start = True
    with pytest.raises(EngineConnectionError, match="cannot start"):
        await pool.start()
    assert pool.state is EngineState.FAILED


async def test_the_audit_notices_an_engine_that_forgot_its_adapters() -> None:
    pool, _runners, clients = make_pool(2, audit_every_s=0.0, rejoin_backoff_s=0.0)
    await pool.start()
    await pool.load_lora_adapter("m@1", "/p1")
    clients[1].loaded.clear()  # restarted between two health checks: nobody saw it go down
    await pool._maintain_once()
    assert not pool.members[1].in_rotation
    await pool._maintain_once()
    assert clients[1].loaded == {"m@1": "/p1"} and pool.members[1].in_rotation
    await pool.stop()


async def test_an_engine_whose_start_failed_is_started_again_with_backoff() -> None:
    pool, runners, _ = make_pool(2, rejoin_backoff_s=30.0)
    runners[1].fail_start = True  # e.g. its warm-up timed out while three engines booted on two cores
    await pool.start()
    member = pool.members[1]
    assert not member.in_rotation and member.start_failures == 1 and member.next_start > 0
    await pool._maintain_once()
    assert member.starting is None  # not before the backoff (30 s)
    member.next_start = 0.0
    await pool._maintain_once()
    assert member.starting is not None
    await member.starting  # fails again: the next try waits twice as long
    assert member.start_failures == 2 and member.next_start - time.monotonic() > 50
    runners[1].fail_start = False
    member.next_start = 0.0
    await pool._maintain_once()
    assert member.starting is not None
    await member.starting
    assert member.in_rotation and member.start_failures == 0
    await pool.stop()
