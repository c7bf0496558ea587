"""The adapter manager's logic against a fake engine client (the real engine is in the integration tests)."""

import asyncio
from pathlib import Path

import httpx
import pytest
from artlike_server.engine.client import EngineModel, EngineRequestError
from artlike_server.errors import Conflict, InvalidRequest, NotFound
from artlike_server.models.manager import ModelManager, ServedModel, parse_model_reference
from artlike_server.models.store import ModelStore

from artlike.types import KeepBest, LoraConfig, RewardHeadConfig, StepRetention


class FakeEngine:
    def __init__(self) -> None:
        self.loaded: dict[str, str] = {}
        self.calls: list[tuple[str, str]] = []

    async def load_lora_adapter(self, name: str, path: str) -> None:
        self.calls.append(("load", name))
        self.loaded[name] = path

    async def unload_lora_adapter(self, name: str) -> None:
        self.calls.append(("unload", name))
        del self.loaded[name]

    async def list_models(self) -> list[EngineModel]:
        return [EngineModel(id="base"), *(EngineModel(id=n) for n in self.loaded)]


def add_step(store: ModelStore, name: str, step: int, *, committed: bool = True) -> None:
    """A step on disk as a job leaves it: the directory, then (committed) its history line."""
    staging = store.new_staging_dir(name)
    (staging / "adapter_config.json").write_text("{}")
    store.commit_step(name, staging, step)
    if committed and step > 0:
        store.append_history(name, {"step": step, "reward": {"mean": step / 10}})


def make_store(tmp_path: Path, steps: int, name: str = "m") -> ModelStore:
    store = ModelStore(tmp_path)
    for step in range(steps):
        add_step(store, name, step)
    store.create(name, "base", LoraConfig())
    return store


def test_parse_model_reference() -> None:
    assert parse_model_reference("m") == ("m", None)
    assert parse_model_reference("m@12") == ("m", 12)
    for malformed in ("m@latest", "m@²", "m@-1", "m@"):
        with pytest.raises(InvalidRequest) as caught:
            parse_model_reference(malformed)
        assert caught.value.status_code == 400 and caught.value.param == "model"


async def test_restore_serves_latest_step_and_resolves_names(tmp_path: Path) -> None:
    engine = FakeEngine()
    manager = ModelManager(make_store(tmp_path, 3), engine, "base")  # type: ignore[arg-type]
    await manager.restore()
    assert list(engine.loaded) == ["m@2"]
    assert await manager.resolve("m") == ServedModel("m@2", "m", 2)
    assert await manager.resolve("base") == ServedModel("base", None, None)
    assert await manager.resolve("m@0") == ServedModel("m@0", "m", 0)  # loaded on demand
    assert "m@0" in engine.loaded
    for missing in ("m@3", "other", "other@1"):
        with pytest.raises(NotFound):
            await manager.resolve(missing)
    assert await manager.served_model_ids() == ["base", "m", "m@0", "m@1", "m@2"]


async def test_publish_moves_alias_and_keeps_latest_k_loaded(tmp_path: Path) -> None:
    store = make_store(tmp_path, 1)
    engine = FakeEngine()
    swaps: list[float] = []
    manager = ModelManager(store, engine, "base", max_loaded=2, on_swap=swaps.append)  # type: ignore[arg-type]
    await manager.restore()
    for step in (1, 2, 3):
        add_step(store, "m", step)
        await manager.publish("m", step)
        assert (await manager.resolve("m")).engine_name == f"m@{step}"
    assert sorted(engine.loaded) == ["m@2", "m@3"]
    assert len(swaps) == 3
    # a step that is leased is not unloaded while the lease is held
    async with manager.lease("m@0") as served:
        assert served.step == 0
        await manager.resolve("m@1")
        assert "m@0" in engine.loaded
    assert len(engine.loaded) <= 3


async def test_publish_fails_loudly_when_the_engine_does_not_list_the_adapter(tmp_path: Path) -> None:
    class ForgetfulEngine(FakeEngine):
        async def list_models(self) -> list[EngineModel]:
            return [EngineModel(id="base")]

    manager = ModelManager(make_store(tmp_path, 2), ForgetfulEngine(), "base")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="does not list"):
        await manager.publish("m", 1)
    assert manager.latest_step("m") is None  # the alias did not move


async def test_publish_when_every_loaded_adapter_is_some_models_latest(tmp_path: Path) -> None:
    """With K=1 and two models, both aliases are pinned; the new step must still survive its own load."""
    store = make_store(tmp_path, 1)
    for step in (0,):
        staging = store.new_staging_dir("n")
        (staging / "adapter_config.json").write_text("{}")
        store.commit_step("n", staging, step)
    store.create("n", "base", LoraConfig())
    engine = FakeEngine()
    manager = ModelManager(store, engine, "base", max_loaded=1)  # type: ignore[arg-type]
    await manager.restore()
    staging = store.new_staging_dir("m")
    (staging / "adapter_config.json").write_text("{}")
    store.commit_step("m", staging, 1)
    await manager.publish("m", 1)
    assert (await manager.resolve("m")).engine_name == "m@1"
    assert "m@1" in engine.loaded and "m@0" not in engine.loaded
    # an old step loaded on demand is not evicted before the request that asked for it uses it
    async with manager.lease("m@0") as served:
        assert served.engine_name in engine.loaded


# ------------------------------------------------------------------------------ restore: nothing bricks a start


class RefusingEngine(FakeEngine):
    """Refuses to load the adapters whose directories it is told are corrupt, as vLLM does (a 500)."""

    def __init__(self, corrupt: set[str]) -> None:
        super().__init__()
        self.corrupt = corrupt

    async def load_lora_adapter(self, name: str, path: str) -> None:
        if name in self.corrupt:
            raise EngineRequestError("POST", "/v1/load_lora_adapter", 500, f"cannot load {path}")
        await super().load_lora_adapter(name, path)


async def test_restore_falls_back_past_a_refused_step_and_serves_the_other_models(tmp_path: Path) -> None:
    store = make_store(tmp_path, 3, "a")  # a@2 is corrupt: a serves step 1
    for step in range(2):
        add_step(store, "b", step)
    add_step(store, "b", 2, committed=False)  # killed between the rename and the history line
    store.create("b", "base", LoraConfig())
    add_step(store, "c", 0)
    store.create("c", "base", LoraConfig())  # c has only a corrupt step 0: not served
    (store.root / "d").mkdir()
    (store.root / "d" / "model.json").write_text("{not json")  # unreadable: skipped, never fatal
    engine = RefusingEngine({"a@2", "c@0"})
    manager = ModelManager(store, engine, "base")  # type: ignore[arg-type]
    await manager.restore()
    assert manager.latest_step("a") == 1 and manager.latest_step("b") == 1
    assert manager.served_models == ["a", "b"]
    assert store.steps("b") == [0, 1]  # the uncommitted step is gone, so it can never be served
    assert store.steps("a") == [0, 1, 2]  # a refused committed step is kept on disk (logged), not deleted
    assert await manager.resolve("a") == ServedModel("a@1", "a", 1)
    with pytest.raises(NotFound):
        await manager.resolve("c")


async def test_restore_propagates_an_engine_that_is_gone(tmp_path: Path) -> None:
    class GoneEngine(FakeEngine):
        async def load_lora_adapter(self, name: str, path: str) -> None:
            raise httpx.ConnectError("connection refused")

    manager = ModelManager(make_store(tmp_path, 2), GoneEngine(), "base")  # type: ignore[arg-type]
    with pytest.raises(httpx.ConnectError):  # the supervisor fails this start and tries again
        await manager.restore()


# ---------------------------------------------------------------------------------------- transactions


async def test_register_commits_model_json_only_after_step_0_is_served(tmp_path: Path) -> None:
    store = ModelStore(tmp_path)
    manager = ModelManager(store, RefusingEngine({"m@0"}), "base")  # type: ignore[arg-type]

    async def write_step0(staging: Path) -> None:
        (staging / "adapter_config.json").write_text("{}")

    with pytest.raises(EngineRequestError):
        await manager.register("m", "base", LoraConfig(), None, write_step0)
    assert not store.model_dir("m").exists() and store.get("m") is None  # nothing half-registered
    manager.engine = FakeEngine()  # type: ignore[assignment]
    model, created = await manager.register("m", "base", LoraConfig(), None, write_step0)
    assert created and store.get("m") == model and manager.latest_step("m") == 0
    again, created = await manager.register("m", "base", LoraConfig(), StepRetention(keep_last=2), write_step0)
    assert not created and again.retention.keep_last == 2 and store.require("m").retention.keep_last == 2
    with pytest.raises(Conflict):
        await manager.register("m", "base", LoraConfig(rank=4), None, write_step0)


def history_entry(step: int, swap_seconds: float) -> dict[str, object]:
    return {"step": step, "swap_seconds": swap_seconds, "reward": {"mean": 0.5}}


async def test_a_failed_publish_rolls_back_and_a_leftover_never_blocks_the_next_commit(tmp_path: Path) -> None:
    store = make_store(tmp_path, 2)
    engine = RefusingEngine({"m@2"})
    manager = ModelManager(store, engine, "base")  # type: ignore[arg-type]
    await manager.restore()
    staging = store.new_staging_dir("m")
    (staging / "adapter_config.json").write_text("{}")
    with pytest.raises(EngineRequestError):
        await manager.commit_step("m", staging, history_entry)
    assert manager.latest_step("m") == 1 and store.steps("m") == [0, 1]
    assert [e["step"] for e in store.read_history("m")] == [1]
    # A rollback that could not delete its directory (the disk, a crash) leaves steps/2 behind: the next
    # commit takes the next free number instead of failing with "already exists" forever.
    add_step(store, "m", 2, committed=False)
    engine.corrupt.clear()
    staging = store.new_staging_dir("m")
    (staging / "adapter_config.json").write_text("{}")
    committed = await manager.commit_step("m", staging, history_entry)
    assert committed.step == 3 and manager.latest_step("m") == 3
    assert [e["step"] for e in store.read_history("m")] == [1, 3]
    restarted = ModelManager(store, FakeEngine(), "base")  # type: ignore[arg-type]
    await restarted.restore()  # a restarted process removes the leftover and serves the committed step
    assert store.steps("m") == [0, 1, 3] and restarted.latest_step("m") == 3


async def test_a_failed_history_append_leaves_the_previous_step_served(tmp_path: Path) -> None:
    store = make_store(tmp_path, 2)
    engine = FakeEngine()
    manager = ModelManager(store, engine, "base")  # type: ignore[arg-type]
    await manager.restore()

    def disk_full(name: str, entry: dict[str, object]) -> None:
        raise OSError(28, "No space left on device")

    store.append_history = disk_full  # type: ignore[method-assign]
    staging = store.new_staging_dir("m")
    (staging / "adapter_config.json").write_text("{}")
    with pytest.raises(OSError):
        await manager.commit_step("m", staging, history_entry)
    assert manager.latest_step("m") == 1 and store.steps("m") == [0, 1] and "m@2" not in engine.loaded


async def test_retention_after_a_commit_keeps_the_policys_steps(tmp_path: Path) -> None:
    store = make_store(tmp_path, 4)  # history reward.mean = step / 10: step 3 is the best so far
    manager = ModelManager(store, FakeEngine(), "base")  # type: ignore[arg-type]
    await manager.restore()
    await manager.set_retention("m", StepRetention(keep_last=1, keep_best=KeepBest(metric="reward.mean", count=1)))
    assert store.steps("m") == [0, 3]  # 0 always, 3 latest and best
    staging = store.new_staging_dir("m")
    (staging / "adapter_config.json").write_text("{}")
    await manager.commit_step("m", staging, lambda step, swap: {"step": step, "reward": {"mean": 0.0}})
    assert store.steps("m") == [0, 3, 4]  # 4 latest, 3 still the best


async def test_evaluations_are_history_lines_that_retention_can_keep_the_best_of(tmp_path: Path) -> None:
    store = make_store(tmp_path, 5)
    manager = ModelManager(store, FakeEngine(), "base")  # type: ignore[arg-type]
    await manager.restore()
    await manager.set_retention("m", StepRetention(keep_last=2))
    assert store.steps("m") == [0, 3, 4]
    entry = await manager.record_evaluation("m", 3, {"accuracy": 0.9}, "validation")
    assert entry["event"] == "eval" and entry["step"] == 3 and entry["eval"] == {"accuracy": 0.9}
    await manager.record_evaluation("m", 4, {"accuracy": 0.4}, "validation")
    await manager.set_retention("m", StepRetention(keep_last=1, keep_best=KeepBest(metric="eval.accuracy")))
    assert store.steps("m") == [0, 3, 4]  # 4 latest, 3 the best evaluated
    assert [line["step"] for line in store.read_history("m") if line.get("event") == "eval"] == [3, 4]
    assert store.committed_steps("m") == [0, 3, 4]
    with pytest.raises(NotFound) as caught:
        await manager.record_evaluation("m", 1, {"accuracy": 1.0}, "validation")  # deleted by retention
    assert caught.value.code == "step_not_found"
    with pytest.raises(NotFound):
        await manager.record_evaluation("nobody", 0, {"accuracy": 1.0}, "validation")


# ------------------------------------------------------------------------------------ leases and deletes


class GatedEngine(FakeEngine):
    """Unloads wait for `gate`: a request can arrive while its adapter is being unloaded."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.unloading = asyncio.Event()

    async def unload_lora_adapter(self, name: str) -> None:
        self.unloading.set()
        await self.gate.wait()
        await super().unload_lora_adapter(name)


async def test_a_request_arriving_during_its_adapters_eviction_gets_it_loaded_again(tmp_path: Path) -> None:
    store = make_store(tmp_path, 3)
    engine = GatedEngine()
    manager = ModelManager(store, engine, "base", max_loaded=1)  # type: ignore[arg-type]
    engine.gate.set()
    await manager.restore()
    await manager.resolve("m@1")  # loaded, unleased: the next load evicts it
    engine.gate.clear()
    engine.unloading.clear()
    evicting = asyncio.create_task(manager.resolve("m@0"))  # loads m@0, then blocks unloading m@1
    await engine.unloading.wait()

    async def use_m1() -> bool:
        async with manager.lease("m@1") as served:
            await evicting  # the unload that was under way has finished by the time the request is served
            return served.engine_name in engine.loaded

    user = asyncio.create_task(use_m1())
    await asyncio.sleep(0)
    engine.gate.set()
    assert await user  # before: the request got m@1 while its unload finished, and the engine 404ed


async def test_deleting_a_step_in_use_waits_for_its_requests_or_refuses(tmp_path: Path) -> None:
    store = make_store(tmp_path, 3)
    manager = ModelManager(store, FakeEngine(), "base", lease_wait_s=0.2)  # type: ignore[arg-type]
    await manager.restore()
    release = asyncio.Event()

    async def hold(model: str) -> None:
        async with manager.lease(model):
            await release.wait()

    holder = asyncio.create_task(hold("m@0"))
    await asyncio.sleep(0)
    with pytest.raises(Conflict) as caught:  # held past the wait: 409, nothing deleted
        await manager.delete_steps("m", [0, 1])
    assert caught.value.code == "step_in_use" and store.steps("m") == [0, 1, 2]
    assert await manager.resolve("m@0")  # it resolves again after the refusal
    manager.lease_wait_s = 5.0
    deleting = asyncio.create_task(manager.delete_steps("m", [0, 1]))
    await asyncio.sleep(0.05)
    with pytest.raises(NotFound):  # being deleted: new requests no longer get it
        await manager.resolve("m@0")
    release.set()
    await holder
    assert await deleting == [0, 1] and store.steps("m") == [2]


async def test_an_engine_restart_during_a_job_reloads_and_touches_no_file(tmp_path: Path) -> None:
    store = make_store(tmp_path, 2)
    manager = ModelManager(store, FakeEngine(), "base")  # type: ignore[arg-type]
    await manager.restore()  # the process's start
    staging = store.new_staging_dir("m")  # a job of this process is writing step 2...
    (staging / "adapter_config.json").write_text("{}")
    add_step(store, "m", 2, committed=False)  # ...or has renamed it and is about to commit it
    manager.engine = FakeEngine()  # type: ignore[assignment]
    await manager.restore()  # the engine crashed and came back
    assert staging.exists() and store.steps("m") == [0, 1, 2]
    assert manager.latest_step("m") == 1 and list(manager.engine.loaded) == ["m@1"]  # type: ignore[attr-defined]


async def test_rollback_and_held_back_steps_survive_a_restart(tmp_path: Path) -> None:
    store = make_store(tmp_path, 3)
    manager = ModelManager(store, FakeEngine(), "base")  # type: ignore[arg-type]
    await manager.restore()
    await manager.set_alias("m", 1, reason="step 2 is worse")
    assert (manager.latest_step("m"), manager.newest_step("m")) == (1, 2)
    assert await manager.resolve("m") == ServedModel("m@1", "m", 1)
    assert await manager.resolve("m@2") == ServedModel("m@2", "m", 2)  # still reachable by its exact name
    assert await manager.served_model_ids() == ["base", "m", "m@0", "m@1", "m@2"]
    # A step trained without promotion: committed and served as m@3, the alias stays at 1.
    staging = store.new_staging_dir("m")
    (staging / "adapter_config.json").write_text("{}")
    committed = await manager.commit_step("m", staging, history_entry, promote=False)
    assert committed.step == 3 and (manager.latest_step("m"), manager.newest_step("m")) == (1, 3)
    assert await manager.resolve("m@3") == ServedModel("m@3", "m", 3)
    restarted = ModelManager(store, FakeEngine(), "base")  # type: ignore[arg-type]
    await restarted.restore()
    assert (restarted.latest_step("m"), restarted.newest_step("m")) == (1, 3)  # the pin is on disk
    await restarted.set_alias("m", 3, reason="promoted")
    assert store.require("m").alias_step is None  # at the newest step the alias follows new steps again
    events = [e for e in store.read_history("m") if e.get("event") == "alias"]
    assert [(e["alias_step"], e["previous_step"], e["reason"]) for e in events] == [
        (1, 2, "step 2 is worse"), (3, 1, "promoted")]
    with pytest.raises(NotFound):
        await restarted.set_alias("m", 9, reason="no such step")
    assert store.committed_steps("m") == [0, 1, 2, 3]  # alias lines never look like steps


async def test_a_reward_model_never_reaches_the_engine_and_only_scores(tmp_path: Path) -> None:
    store = ModelStore(tmp_path)
    engine = FakeEngine()
    manager = ModelManager(store, engine, "base")  # type: ignore[arg-type]

    async def write_step0(staging: Path) -> None:
        (staging / "adapter_config.json").write_text("{}")

    head = RewardHeadConfig(num_objectives=2)
    model, created = await manager.register("rm", "base", LoraConfig(), None, write_step0, kind="reward",
                                            reward_head=head)
    assert created and model.kind == "reward" and store.require("rm").reward_head == head
    staging = store.new_staging_dir("rm")
    (staging / "adapter_config.json").write_text("{}")
    committed = await manager.commit_step("rm", staging, history_entry)
    assert committed.step == 1 and manager.latest_step("rm") == 1 and engine.calls == []
    assert manager.resolve_reward_model("rm") == ServedModel("rm@1", "rm", 1)
    assert manager.resolve_reward_model("rm@0") == ServedModel("rm@0", "rm", 0)
    with pytest.raises(InvalidRequest) as chat:
        await manager.resolve("rm")
    assert chat.value.code == "reward_model_not_generative"
    assert await manager.served_model_ids() == ["base"]
    with pytest.raises(Conflict):  # the same name as a policy
        await manager.register("rm", "base", LoraConfig(), None, write_step0)

    restarted = ModelManager(store, engine, "base")  # type: ignore[arg-type]
    await restarted.restore()
    assert restarted.latest_step("rm") == 1 and restarted.is_reward_model("rm") and engine.calls == []
    await restarted.set_alias("rm", 0, reason="rollback")
    assert restarted.resolve_reward_model("rm") == ServedModel("rm@0", "rm", 0) and engine.calls == []
    add_step(store, "p", 0)
    store.create("p", "base", LoraConfig())
    await restarted.restore()
    with pytest.raises(InvalidRequest) as policy:
        restarted.resolve_reward_model("p")
    assert policy.value.code == "not_a_reward_model"
