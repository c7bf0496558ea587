"""Importing a PEFT LoRA adapter trained elsewhere: every refusal (files, config, base, rank, dtype) with its
OpenAI-shaped error, the import into a data dir with no server, the tar the route reads, and the route's
service over the real model manager with a fake engine. Tiny adapters and bases: safetensors and JSON only."""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from artlike_server import cli as server_cli
from artlike_server.adapter_import.archive import pack_adapter, unpack_adapter
from artlike_server.adapter_import.check import BaseModel, check_adapter
from artlike_server.adapter_import.offline import import_offline
from artlike_server.adapter_import.service import ImportService
from artlike_server.data_dir_lock import DataDirInUse, DataDirLock
from artlike_server.engine.client import EngineModel
from artlike_server.errors import APIError, Conflict, InvalidRequest
from artlike_server.export.formats import export_request
from artlike_server.export.run import export_step
from artlike_server.export.source import find_step
from artlike_server.models.manager import ModelManager
from artlike_server.models.registry import ModelRegistry
from artlike_server.models.store import ModelStore
from artlike_server.state import BaseModelInfo
from safetensors.numpy import save_file
from typer.testing import CliRunner

from artlike.types import LoraConfig

HIDDEN, FFN, LAYERS, VOCAB = 8, 16, 2, 32
BASE_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture
def base(tmp_path: Path) -> BaseModel:
    """A llama-shaped base with real safetensors weights (zeros): what the checks read the shapes from."""
    directory = tmp_path / "SmolLM2-135M-Instruct"
    directory.mkdir()
    weights = {"model.embed_tokens.weight": np.zeros((VOCAB, HIDDEN), np.float32),
               "model.norm.weight": np.zeros(HIDDEN, np.float32), "lm_head.weight": np.zeros((VOCAB, HIDDEN), np.float32)}
    for layer in range(LAYERS):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            weights[f"model.layers.{layer}.self_attn.{proj}.weight"] = np.zeros((HIDDEN, HIDDEN), np.float32)
        weights[f"model.layers.{layer}.mlp.up_proj.weight"] = np.zeros((FFN, HIDDEN), np.float32)
        weights[f"model.layers.{layer}.mlp.down_proj.weight"] = np.zeros((HIDDEN, FFN), np.float32)
        weights[f"model.layers.{layer}.input_layernorm.weight"] = np.zeros(HIDDEN, np.float32)
    save_file(weights, str(directory / "model.safetensors"))
    (directory / "config.json").write_text("{}")
    return BaseModel(BASE_ID, directory, max_lora_rank=8)


def write_adapter(directory: Path, *, rank: int = 4, targets: tuple[str, ...] = ("q_proj", "v_proj"),
                  config: dict[str, Any] | None = None, dtype: Any = np.float32,
                  tensors: dict[str, np.ndarray] | None = None) -> Path:
    """A PEFT LoRA adapter directory as PEFT saves one (keys `base_model.model.<module>.lora_A.weight`)."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    weights = {}
    for layer in range(LAYERS):
        for target in targets:
            module = f"model.layers.{layer}.{'mlp' if target.endswith(('up_proj', 'down_proj')) else 'self_attn'}.{target}"
            out_features, in_features = (FFN, HIDDEN) if target == "up_proj" else (HIDDEN, FFN) \
                if target == "down_proj" else (HIDDEN, HIDDEN)
            weights[f"base_model.model.{module}.lora_A.weight"] = rng.normal(size=(rank, in_features)).astype(dtype)
            weights[f"base_model.model.{module}.lora_B.weight"] = rng.normal(size=(out_features, rank)).astype(dtype)
    save_file(weights if tensors is None else tensors, str(directory / "adapter_model.safetensors"))
    values = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
              "lora_dropout": 0.05, "target_modules": list(targets), "bias": "none",
              "base_model_name_or_path": BASE_ID, "peft_version": "0.17.0", **(config or {})}
    (directory / "adapter_config.json").write_text(json.dumps(values))
    return directory


def refused(directory: Path, base: BaseModel, **options: Any) -> APIError:
    with pytest.raises(InvalidRequest) as caught:
        check_adapter(directory, base, **options)
    error = caught.value
    assert error.status_code == 400 and error.body()["error"]["type"] == "invalid_request_error"
    return error


def test_a_plain_lora_on_the_same_base_is_accepted_as_the_model_would_record_it(tmp_path: Path, base: BaseModel) -> None:
    checked = check_adapter(write_adapter(tmp_path / "a"), base)
    assert checked.lora == LoraConfig(rank=4, alpha=8.0, dropout=0.05, target_modules=["q_proj", "v_proj"])
    assert checked.dtypes == ("float32",) and checked.modules == 2 * LAYERS
    bf16 = check_adapter(write_adapter(tmp_path / "h", dtype=np.float16), base)
    assert bf16.dtypes == ("float16",)


@pytest.mark.parametrize("named", [BASE_ID, "unsloth/SmolLM2-135M-Instruct-bnb-4bit", "/home/me/SmolLM2-135M-Instruct",
                                   None])
def test_the_same_base_under_another_name_counts(tmp_path: Path, base: BaseModel, named: str | None) -> None:
    check_adapter(write_adapter(tmp_path / "a", config={"base_model_name_or_path": named}), base)


def test_another_base_is_refused_by_name_and_by_shapes(tmp_path: Path, base: BaseModel) -> None:
    other = write_adapter(tmp_path / "named", config={"base_model_name_or_path": "meta-llama/Llama-3.2-1B"})
    error = refused(other, base)
    assert error.param == "adapter_config.base_model_name_or_path" and error.code == "base_model_mismatch"
    assert "Llama-3.2-1B" in error.message and "--any-base-name" in error.message
    check_adapter(other, base, any_base_name=True)  # the name alone; the shapes fit

    wide = {f"base_model.model.model.layers.0.self_attn.q_proj.lora_{which}.weight": np.ones(shape, np.float32)
            for which, shape in (("A", (4, 2 * HIDDEN)), ("B", (2 * HIDDEN, 4)))}
    error = refused(write_adapter(tmp_path / "wide", tensors=wide), base, any_base_name=True)
    assert error.param == "adapter_model.safetensors" and error.code == "base_model_mismatch"
    assert "16x16" in error.message and "8x8" in error.message

    deeper = {f"base_model.model.model.layers.7.self_attn.q_proj.lora_{which}.weight": np.ones((4, HIDDEN), np.float32)
              if which == "A" else np.ones((HIDDEN, 4), np.float32) for which in "AB"}
    error = refused(write_adapter(tmp_path / "deeper", tensors=deeper), base)
    assert error.code == "base_model_mismatch" and "model.layers.7.self_attn.q_proj" in error.message


def test_modules_the_engine_does_not_serve_are_refused(tmp_path: Path, base: BaseModel) -> None:
    head = {"base_model.model.lm_head.lora_A.weight": np.ones((4, HIDDEN), np.float32),
            "base_model.model.lm_head.lora_B.weight": np.ones((VOCAB, 4), np.float32)}
    error = refused(write_adapter(tmp_path / "head", tensors=head, config={"target_modules": ["lm_head"]}), base)
    assert error.param == "adapter_config.target_modules" and error.code == "invalid_target_modules"
    assert "q_proj" in error.message  # the servable choices are listed

    magnitude = write_adapter(tmp_path / "extra")
    tensors = {"base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector": np.ones(HIDDEN, np.float32)}
    save_file(tensors, str(magnitude / "adapter_model.safetensors"))
    error = refused(magnitude, base)
    assert error.param == "adapter_model.safetensors" and error.code == "unsupported_adapter"


@pytest.mark.parametrize(("field", "value"), [
    ("use_dora", True), ("modules_to_save", ["lm_head"]), ("lora_bias", True), ("bias", "all"),
    ("init_lora_weights", "pissa"), ("peft_type", "IA3"), ("task_type", "SEQ_CLS"), ("fan_in_fan_out", True),
    ("trainable_token_indices", [1, 2]),
])
def test_what_is_not_a_plain_causal_lora_is_refused_naming_the_field(
        tmp_path: Path, base: BaseModel, field: str, value: Any) -> None:
    error = refused(write_adapter(tmp_path / "a", config={field: value}), base)
    assert error.param == f"adapter_config.{field}" and error.code == "unsupported_adapter"


def test_a_rank_above_the_engines_limit_is_refused(tmp_path: Path, base: BaseModel) -> None:
    error = refused(write_adapter(tmp_path / "a", rank=16), base)
    assert error.param == "adapter_config.r" and error.code == "invalid_value" and "--max-lora-rank 8" in error.message
    pattern = write_adapter(tmp_path / "p", config={"rank_pattern": {"v_proj": 32}})
    assert refused(pattern, base).param == "adapter_config.r"
    lying = write_adapter(tmp_path / "l", rank=16, config={"r": 4})  # the tensors' rank decides too
    assert refused(lying, base).param == "adapter_config.r"
    disagreeing = write_adapter(tmp_path / "d", rank=2, config={"r": 4})
    error = refused(disagreeing, base)
    assert error.param == "adapter_model.safetensors" and error.code == "invalid_adapter" and "r=4" in error.message


def test_unsupported_dtypes_are_refused(tmp_path: Path, base: BaseModel) -> None:
    error = refused(write_adapter(tmp_path / "a", dtype=np.float64), base)
    assert error.param == "adapter_model.safetensors" and error.code == "unsupported_dtype" and "F64" in error.message


def test_missing_and_corrupt_files_are_refused(tmp_path: Path, base: BaseModel) -> None:
    error = refused(tmp_path / "nowhere", base)
    assert error.param == "adapter" and error.code == "invalid_adapter"

    no_config = write_adapter(tmp_path / "c")
    (no_config / "adapter_config.json").unlink()
    assert "adapter_config.json" in refused(no_config, base).message

    pickled = write_adapter(tmp_path / "bin")
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    error = refused(pickled, base)
    assert error.param == "adapter" and error.code == "unsupported_adapter_format" and "pickle" in error.message

    (pickled / "adapter_model.bin").unlink()
    assert refused(pickled, base).code == "invalid_adapter"

    bad_json = write_adapter(tmp_path / "j")
    (bad_json / "adapter_config.json").write_text("{not json")
    assert refused(bad_json, base).param == "adapter"

    truncated = write_adapter(tmp_path / "t")
    weights = truncated / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])
    error = refused(truncated, base)
    assert error.param == "adapter_model.safetensors" and error.code == "invalid_adapter" and "truncated" in error.message

    garbage = write_adapter(tmp_path / "g")
    (garbage / "adapter_model.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    assert refused(garbage, base).param == "adapter_model.safetensors"

    half = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": np.ones((4, HIDDEN), np.float32)}
    error = refused(write_adapter(tmp_path / "half", tensors=half), base)
    assert error.code == "invalid_adapter" and "lora_B" in error.message


# ------------------------------------------------------------------------------------- into a data dir


def test_an_import_without_a_server_creates_the_model_then_adds_steps(tmp_path: Path, base: BaseModel) -> None:
    data_dir = tmp_path / "data"
    checked = check_adapter(write_adapter(tmp_path / "a"), base)
    created = import_offline(data_dir, "imported", checked, base)
    assert (created.step, created.created, created.promoted) == (0, True, True)
    store = ModelStore(data_dir)
    model = store.require("imported")
    assert model.base_model == BASE_ID and model.lora == checked.lora
    config = json.loads((store.step_dir("imported", 0) / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base.path) and config["inference_mode"] is True
    assert sorted(p.name for p in store.step_dir("imported", 0).iterdir()) == ["adapter_config.json",
                                                                              "adapter_model.safetensors"]

    again = import_offline(data_dir, "imported", checked, base)
    held = import_offline(data_dir, "imported", checked, base, promote=False)
    assert (again.step, held.step) == (1, 2) and store.committed_steps("imported") == [0, 1, 2]
    assert store.require("imported").alias_step == 1  # held back: the alias stays on step 1
    history = store.read_history("imported")
    assert [(line["event"], line["step"], line["promoted"]) for line in history] == [
        ("import", 0, True), ("import", 1, True), ("import", 2, False)]
    assert history[0]["source"]["base_model_name_or_path"] == BASE_ID


def test_an_import_that_does_not_fit_the_model_writes_nothing(tmp_path: Path, base: BaseModel) -> None:
    data_dir = tmp_path / "data"
    import_offline(data_dir, "m", check_adapter(write_adapter(tmp_path / "a"), base), base)
    other = check_adapter(write_adapter(tmp_path / "b", rank=2, targets=("q_proj", "up_proj")), base)
    with pytest.raises(Conflict) as caught:
        import_offline(data_dir, "m", other, base)
    assert caught.value.code == "lora_config_mismatch" and caught.value.param == "model"
    assert "rank 4" in caught.value.message and "up_proj" in caught.value.message
    store = ModelStore(data_dir)
    assert store.steps("m") == [0] and len(store.read_history("m")) == 1
    assert not any((store.model_dir("m") / ".staging").glob("*"))


def test_an_import_without_a_server_waits_for_nobody_when_one_holds_the_data_dir(tmp_path: Path, base: BaseModel) -> None:
    data_dir = tmp_path / "data"
    checked = check_adapter(write_adapter(tmp_path / "a"), base)
    with DataDirLock(data_dir), pytest.raises(DataDirInUse):
        import_offline(data_dir, "m", checked, base)
    assert ModelStore(data_dir).get("m") is None


# ------------------------------------------------------------------------------------------- the tar


def test_the_tar_carries_only_the_adapters_files_and_is_read_under_one_top_directory(
        tmp_path: Path, base: BaseModel) -> None:
    adapter = write_adapter(tmp_path / "a")
    (adapter / "optimizer.pt").write_bytes(b"pickle")
    with tarfile.open(fileobj=io.BytesIO(pack_adapter(adapter))) as archive:
        assert sorted(archive.getnames()) == ["adapter_config.json", "adapter_model.safetensors"]

    nested = tmp_path / "nested.tar"
    with tarfile.open(nested, "w") as archive:
        for path in adapter.iterdir():
            archive.add(path, arcname=f"checkpoint-500/{path.name}")
    unpacked = unpack_adapter(nested, tmp_path / "out")
    assert sorted(p.name for p in unpacked.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    check_adapter(unpacked, base)

    not_tar = tmp_path / "x.tar"
    not_tar.write_bytes(b"PK\x03\x04 a zip")
    with pytest.raises(InvalidRequest) as caught:
        unpack_adapter(not_tar, tmp_path / "none")
    assert caught.value.param == "adapter" and caught.value.code == "invalid_adapter"


# ------------------------------------------------------------------------------------------- the route's service


class FakeEngine:
    def __init__(self) -> None:
        self.loaded: dict[str, str] = {}

    async def load_lora_adapter(self, name: str, path: str) -> None:
        self.loaded[name] = path

    async def unload_lora_adapter(self, name: str) -> None:
        del self.loaded[name]

    async def list_models(self) -> list[EngineModel]:
        return [EngineModel(id=BASE_ID), *(EngineModel(id=n) for n in self.loaded)]


async def _no_init(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("an import writes its own step 0")


async def chunks(data: bytes) -> AsyncIterator[bytes]:
    for start in range(0, len(data), 4096):
        yield data[start:start + 4096]


async def test_the_service_serves_the_import_at_once_and_refuses_cleanly(tmp_path: Path, base: BaseModel) -> None:
    data_dir = tmp_path / "data"
    store, engine = ModelStore(data_dir), FakeEngine()
    manager = ModelManager(store, engine, BASE_ID)  # type: ignore[arg-type]
    training: set[str] = set()
    registry = ModelRegistry(store, manager, _no_init, BaseModelInfo(BASE_ID, base.path, 8),
                             is_training=training.__contains__)
    service = ImportService(data_dir, registry)
    archive = pack_adapter(write_adapter(tmp_path / "a"))

    first = await service.import_archive("svc", chunks(archive))
    assert first["served_name"] == "svc@0" and first["created"] is True
    second = await service.import_archive("svc", chunks(archive))
    assert (second["served_name"], second["created"], second["promoted"]) == ("svc@1", False, True)
    assert manager.latest_step("svc") == 1 and set(engine.loaded) >= {"svc@0", "svc@1"}
    assert "svc@1" in await manager.served_model_ids()

    training.add("svc")
    with pytest.raises(Conflict) as busy:
        await service.import_archive("svc", chunks(archive))
    assert busy.value.code == "training_in_progress"

    big = pack_adapter(write_adapter(tmp_path / "big", rank=16))
    with pytest.raises(InvalidRequest) as caught:
        await service.import_archive("fresh", chunks(big))
    assert caught.value.param == "adapter_config.r"
    assert store.get("fresh") is None and not store.model_dir("fresh").exists()
    assert not any((data_dir / "imports").iterdir())  # the upload is gone either way


# ------------------------------------------------------------------------------------------- the command


def test_the_command_imports_into_a_data_dir_and_says_why_it_refuses(tmp_path: Path, base: BaseModel,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ARTLIKE_SERVER", raising=False)
    runner = CliRunner()
    data_dir = tmp_path / "data"
    adapter = write_adapter(tmp_path / "a")
    common = ["--data-dir", str(data_dir), "--base-model", str(base.path), "--max-lora-rank", "8"]
    done = runner.invoke(server_cli.app, ["import", str(adapter), "cli-model", *common])
    assert done.exit_code == 0, done.output
    assert "imported" in done.output and "cli-model@0" in done.output
    assert ModelStore(data_dir).committed_steps("cli-model") == [0]

    big = write_adapter(tmp_path / "big", rank=16)
    refusal = runner.invoke(server_cli.app, ["import", str(big), "cli-model", *common])
    assert refusal.exit_code == 2 and "--max-lora-rank 8 [adapter_config.r]" in refusal.output

    unreachable = runner.invoke(server_cli.app, ["import", str(adapter), "cli-model", "--server",
                                                 "http://127.0.0.1:9"])
    assert unreachable.exit_code == 2 and "cannot reach the server" in unreachable.output


def test_an_imported_step_exports_as_peft_with_a_card_that_says_it_was_imported(tmp_path: Path, base: BaseModel) -> None:
    data_dir = tmp_path / "data"
    import_offline(data_dir, "m", check_adapter(write_adapter(tmp_path / "a"), base), base)
    out = export_step(find_step(data_dir, "m@0"), export_request("peft"), tmp_path / "out")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == BASE_ID and config["r"] == 4
    assert "trained elsewhere and imported" in (out / "README.md").read_text()


def test_the_command_goes_to_the_server_that_holds_the_data_dir_before_checking_anything(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ARTLIKE_SERVER", raising=False)
    data_dir = tmp_path / "data"
    adapter = write_adapter(tmp_path / "a", config={"base_model_name_or_path": "some/other-base"})
    monkeypatch.setattr(server_cli, "DEFAULT_SERVER_URL", "http://127.0.0.1:9")
    with DataDirLock(data_dir):
        result = CliRunner().invoke(server_cli.app, ["import", str(adapter), "m", "--data-dir", str(data_dir)])
    assert result.exit_code == 2
    assert "importing through the server at http://127.0.0.1:9" in result.output
    assert "cannot reach the server" in result.output and "base_model_mismatch" not in result.output
