"""Folding a LoRA adapter into base weights (engine/adapter_merge.py, engine/merge_check.py): worked examples,
the refusals, and the result against PEFT's own `merge_and_unload` on a tiny Llama."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from artlike_server.engine.adapter_merge import (
    LoraDelta,
    lora_scaling,
    merged_weight,
    merged_weights,
    pattern_value,
    read_adapter,
)
from artlike_server.engine.merge_check import UnsupportedAdapter, check_mergeable
from safetensors.torch import load_file, save_file


def test_merged_weight_worked_example() -> None:
    # W = I, A = [[1, 2]], B = [[1], [0]], scaling 2: 2·B@A = [[2, 4], [0, 0]], so W' = [[3, 4], [0, 1]].
    delta = LoraDelta(a=torch.tensor([[1.0, 2.0]]), b=torch.tensor([[1.0], [0.0]]), scaling=2.0)
    assert torch.equal(merged_weight(torch.eye(2), delta), torch.tensor([[3.0, 4.0], [0.0, 1.0]]))
    assert merged_weight(torch.eye(2, dtype=torch.bfloat16), delta).dtype == torch.bfloat16


def test_scaling_and_patterns() -> None:
    assert lora_scaling(16, 8, rslora=False) == 2.0
    assert lora_scaling(16, 4, rslora=True) == 8.0  # alpha / sqrt(r)
    with pytest.raises(UnsupportedAdapter):
        lora_scaling(16, 0, rslora=False)
    patterns = {"q_proj": 4.0, r"model\.layers\.1\..*": 2.0}
    assert pattern_value(patterns, "model.layers.0.self_attn.q_proj", 8.0) == 4.0
    assert pattern_value(patterns, "model.layers.1.mlp.up_proj", 8.0) == 2.0
    assert pattern_value(patterns, "model.layers.0.mlp.up_proj", 8.0) == 8.0


def write_adapter(root: Path, config: dict[str, object], tensors: dict[str, torch.Tensor]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 1, "lora_alpha": 1, **config}))
    save_file(tensors, str(root / "adapter_model.safetensors"))
    return root


@pytest.fixture
def base_dir(tmp_path: Path) -> Path:
    path = tmp_path / "base"
    path.mkdir()
    save_file({"layer.weight": torch.eye(2), "norm.weight": torch.ones(2)}, str(path / "model.safetensors"))
    return path


GOOD = {"base_model.model.layer.lora_A.weight": torch.ones(1, 2), "base_model.model.layer.lora_B.weight": torch.ones(2, 1)}


@pytest.mark.parametrize(("config", "tensors", "reason"), [
    ({"use_dora": True}, GOOD, "DoRA"),
    ({"modules_to_save": ["lm_head"]}, GOOD, "modules_to_save"),
    ({"bias": "all"}, GOOD, "biases"),
    ({"peft_type": "IA3"}, GOOD, "only LoRA"),
    ({}, {"base_model.model.layer.lora_A.weight": torch.ones(1, 2)}, "lacks its lora_B"),
    ({}, {**GOOD, "base_model.model.layer.lora_B.weight": torch.ones(3, 1)}, "do not fit"),
    ({}, {"base_model.model.other.lora_A.weight": torch.ones(1, 2),
          "base_model.model.other.lora_B.weight": torch.ones(2, 1)}, "no weight 'other.weight'"),
    ({}, {**GOOD, "base_model.model.lm_head.weight": torch.ones(2, 2)}, "not a LoRA A/B matrix"),
])
def test_unmergeable_adapters_are_refused_from_their_headers(tmp_path: Path, base_dir: Path, config: dict[str, object],
                                                            tensors: dict[str, torch.Tensor], reason: str) -> None:
    adapter = write_adapter(tmp_path / "adapter", config, tensors)
    with pytest.raises(UnsupportedAdapter, match=reason):
        check_mergeable(adapter, base_dir)
    with pytest.raises(UnsupportedAdapter, match=reason):
        read_adapter(adapter, base_dir)


def test_a_missing_directory_is_refused(tmp_path: Path, base_dir: Path) -> None:
    with pytest.raises(UnsupportedAdapter, match="not a PEFT adapter directory"):
        check_mergeable(tmp_path / "nowhere", base_dir)


def test_no_adapter_gives_the_base_weights_back(base_dir: Path) -> None:
    weights = dict(merged_weights(base_dir, {}))
    assert set(weights) == {"layer.weight", "norm.weight"} and torch.equal(weights["layer.weight"], torch.eye(2))


@pytest.mark.parametrize("variant", [{}, {"use_rslora": True}, {"rank_pattern": {"q_proj": 2}, "alpha_pattern": {"down_proj": 3}}])
def test_the_merge_equals_peft_merge_and_unload(tmp_path: Path, variant: dict[str, object]) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    base = LlamaForCausalLM(config)
    base_dir = tmp_path / "base"
    base.save_pretrained(base_dir, safe_serialization=True)
    lora = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], **variant)  # type: ignore[arg-type]
    peft_model = get_peft_model(base, lora)
    adapter_dir = tmp_path / "adapter"
    peft_model.save_pretrained(adapter_dir)
    expected = peft_model.merge_and_unload().state_dict()

    ours = dict(merged_weights(base_dir, read_adapter(adapter_dir, base_dir)))
    original = load_file(str(base_dir / "model.safetensors"))
    assert set(ours) == set(original)
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6, msg=name)
    changed = {name for name in ours if not torch.equal(ours[name], original[name])}
    assert len(changed) == 14 and all(name.endswith("_proj.weight") for name in changed)  # 7 projections × 2 layers
