"""Pure parts of the model lifecycle: which steps a retention policy lets go, and which LoRA targets the base
model can serve (read from its real safetensors header, the embedded default model's layout)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from artlike_server.errors import InvalidRequest
from artlike_server.models.retention import metric_value, steps_to_delete
from artlike_server.models.targets import check_target_modules, read_module_names

from artlike.types import DEFAULT_LORA_TARGETS, KeepBest, StepRetention

HISTORY = [{"step": s, "reward": {"mean": m}} for s, m in ((1, 0.2), (2, 0.9), (3, 0.4), (4, 0.1), (5, 0.3))]


def test_the_docstrings_worked_example() -> None:
    policy = StepRetention(keep_last=2, keep_best=KeepBest(metric="reward.mean", mode="max", count=1))
    assert steps_to_delete([0, 1, 2, 3, 4, 5], 5, HISTORY, policy) == [1, 3]


def test_no_rule_keeps_everything_and_step_0_and_the_latest_are_always_kept() -> None:
    assert steps_to_delete([0, 1, 2], 2, HISTORY, StepRetention()) == []
    assert steps_to_delete([0, 1, 2, 3], 3, HISTORY, StepRetention(keep_last=1)) == [1, 2]
    # keep_best with mode min: the lowest reward wins; a latest that scores worst is kept anyway
    policy = StepRetention(keep_best=KeepBest(metric="reward.mean", mode="min", count=1))
    assert steps_to_delete([0, 1, 2, 3, 4, 5], 5, HISTORY, policy) == [1, 2, 3]


def test_a_metric_missing_from_history_never_wins() -> None:
    policy = StepRetention(keep_best=KeepBest(metric="metrics.accuracy", count=2))
    assert steps_to_delete([0, 1, 2, 3], 3, HISTORY, policy) == [1, 2]
    assert metric_value({"a": {"b": 1}}, "a.b") == 1.0
    assert metric_value({"a": {"b": "x"}}, "a.b") is None and metric_value({"a": 1}, "a.b") is None
    assert metric_value({"a": float("nan")}, "a") is None and metric_value({"a": True}, "a") is None


def write_safetensors_header(path: Path, shapes: dict[str, list[int]]) -> None:
    header = json.dumps({k: {"dtype": "F32", "shape": v, "data_offsets": [0, 0]} for k, v in shapes.items()})
    path.write_bytes(struct.pack("<Q", len(header)) + header.encode())


@pytest.fixture
def llama_like(tmp_path: Path) -> Path:
    shapes = {"model.embed_tokens.weight": [100, 8], "model.norm.weight": [8], "lm_head.weight": [100, 8]}
    for layer in range(2):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[f"model.layers.{layer}.self_attn.{proj}.weight"] = [8, 8]
        for proj in ("gate_proj", "up_proj", "down_proj"):
            shapes[f"model.layers.{layer}.mlp.{proj}.weight"] = [8, 8]
        shapes[f"model.layers.{layer}.input_layernorm.weight"] = [8]
    write_safetensors_header(tmp_path / "model.safetensors", shapes)
    return tmp_path


def test_decoder_block_linear_layers_are_servable_targets(llama_like: Path) -> None:
    modules = read_module_names(llama_like)
    assert modules is not None
    assert modules.servable_short_names == sorted(DEFAULT_LORA_TARGETS)
    check_target_modules(list(DEFAULT_LORA_TARGETS), modules)
    check_target_modules(["self_attn.q_proj", "model.layers.0.mlp.down_proj"], modules)  # PEFT's suffix match


@pytest.mark.parametrize("target", ["embed_tokens", "model.norm", "lm_head", "input_layernorm", "nonexistent_proj"])
def test_other_targets_are_a_400_naming_the_parameter_and_the_choices(llama_like: Path, target: str) -> None:
    modules = read_module_names(llama_like)
    assert modules is not None
    with pytest.raises(InvalidRequest) as caught:
        check_target_modules(["q_proj", target], modules)
    assert caught.value.param == "lora.target_modules" and caught.value.code == "invalid_target_modules"
    assert repr(target) in caught.value.message and "q_proj" in caught.value.message


def test_a_model_without_safetensors_is_left_to_the_trainer(tmp_path: Path) -> None:
    assert read_module_names(tmp_path) is None and read_module_names(tmp_path / "no-such-dir") is None
