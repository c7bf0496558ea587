from pathlib import Path

import pytest
from artlike_server.errors import InvalidRequest, NotFound
from artlike_server.models.store import ModelStore

from artlike.types import LoraConfig


def make_adapter(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text("{}")
    (directory / "adapter_model.safetensors").write_bytes(b"weights")
    return directory


def test_model_exists_only_after_create(tmp_path: Path) -> None:
    store = ModelStore(tmp_path)
    staging = make_adapter(store.new_staging_dir("m"))
    store.commit_step("m", staging, 0)
    assert store.get("m") is None  # step 0 alone is not a registered model
    store.create("m", "base", LoraConfig(rank=4))
    model = store.require("m")
    assert (model.name, model.base_model, model.lora.rank) == ("m", "base", 4)
    assert store.steps("m") == [0]
    assert [m.name for m in store.all()] == ["m"]


def test_commit_refuses_incomplete_or_existing_steps(tmp_path: Path) -> None:
    store = ModelStore(tmp_path)
    empty = store.new_staging_dir("m")
    with pytest.raises(RuntimeError, match="no PEFT adapter"):
        store.commit_step("m", empty, 1)
    store.commit_step("m", make_adapter(store.new_staging_dir("m")), 1)
    with pytest.raises(RuntimeError, match="already exists"):
        store.commit_step("m", make_adapter(store.new_staging_dir("m")), 1)


def test_half_written_step_is_invisible(tmp_path: Path) -> None:
    store = ModelStore(tmp_path)
    store.commit_step("m", make_adapter(store.new_staging_dir("m")), 0)
    (store.step_dir("m", 1)).mkdir()  # a directory without adapter_config.json, e.g. a crash mid-copy
    assert store.steps("m") == [0]
    assert store.latest_step("m") == 0


def test_delete_step(tmp_path: Path) -> None:
    store = ModelStore(tmp_path)
    for step in range(3):
        store.commit_step("m", make_adapter(store.new_staging_dir("m")), step)
    store.delete_step("m", 0)
    assert store.steps("m") == [1, 2]


@pytest.mark.parametrize("name", ["../etc", "a/b", "m@3", "", ".hidden", "x" * 65])
def test_names_that_could_escape_the_data_dir_are_rejected(tmp_path: Path, name: str) -> None:
    with pytest.raises(InvalidRequest):
        ModelStore(tmp_path).model_dir(name)


def test_require_unknown_model(tmp_path: Path) -> None:
    with pytest.raises(NotFound):
        ModelStore(tmp_path).require("nope")


def test_history_survives_a_torn_last_line(tmp_path: Path) -> None:
    store = ModelStore(tmp_path)
    store.model_dir("m").mkdir(parents=True)
    store.append_history("m", {"step": 1, "reward": {"mean": 0.5}})
    with open(store.model_dir("m") / "history.jsonl", "ab") as handle:
        handle.write(b'{"step": 2, "rew')  # a crash mid-append
    assert store.read_history("m") == [{"step": 1, "reward": {"mean": 0.5}}]
