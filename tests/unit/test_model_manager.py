"""The adapter manager's logic against a fake engine client (the real engine is in the integration tests)."""

from pathlib import Path

import pytest
from artlike_server.engine.client import EngineModel
from artlike_server.errors import InvalidRequest, NotFound
from artlike_server.models.manager import ModelManager, ServedModel, parse_model_reference
from artlike_server.models.store import ModelStore

from artlike.types import LoraConfig


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


def make_store(tmp_path: Path, steps: int) -> ModelStore:
    store = ModelStore(tmp_path)
    for step in range(steps):
        staging = store.new_staging_dir("m")
        (staging / "adapter_config.json").write_text("{}")
        store.commit_step("m", staging, step)
    store.create("m", "base", LoraConfig())
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
        staging = store.new_staging_dir("m")
        (staging / "adapter_config.json").write_text("{}")
        store.commit_step("m", staging, step)
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
