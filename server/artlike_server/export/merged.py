"""The `merged` format: the base model with the step's LoRA merged into its weights (PEFT's
`merge_and_unload`), saved as a plain Hugging Face directory that vLLM, transformers and llama.cpp's
converter load without PEFT: safetensors, config, generation config, tokenizer and chat template.

A reward model's step becomes an `AutoModelForSequenceClassification` model: its score head is the
`score` layer PEFT keeps beside the adapter, and `num_labels` is the number of objectives.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from peft import PeftModel
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
)

from ..errors import InvalidRequest
from .source import StepSource


def merged_model(source: StepSource, dtype: torch.dtype) -> PreTrainedModel:
    """Base + adapter, merged, in `dtype` (merged in float32, cast afterwards, so the sum is not rounded twice)."""
    if source.kind == "reward":
        head = source.reward_head
        if head is not None and head.pooling != "last":
            raise InvalidRequest(f"{source.reference} pools its hidden states by {head.pooling!r}; a sequence "
                                 "classification model pools the last token, so only the peft format keeps "
                                 "its scores", param="format", code="unsupported_export")
        labels = head.names if head is not None else ["score"]
        base: Any = AutoModelForSequenceClassification.from_pretrained(
            str(source.base_path), num_labels=len(labels), dtype=torch.float32,
            id2label=dict(enumerate(labels)), label2id={label: k for k, label in enumerate(labels)})
    else:
        base = AutoModelForCausalLM.from_pretrained(str(source.base_path), dtype=torch.float32)
    model: Any = PeftModel.from_pretrained(base, str(source.step_dir)).merge_and_unload()
    model.to(dtype)
    model.config.dtype = dtype
    return model  # type: ignore[no-any-return]


def write_merged(source: StepSource, out: Path, dtype: torch.dtype) -> None:
    model = merged_model(source, dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(source.base_path))
    if source.kind == "reward" and model.config.pad_token_id is None:
        # Sequence classification finds each row's last token by the pad id; without one it scores batches of one.
        model.config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    model.config.name_or_path = source.base_model_id
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))  # the chat template goes with it (chat_template.jinja)
    if source.kind != "reward":
        try:
            generation = GenerationConfig.from_pretrained(str(source.base_path))
        except OSError:
            generation = GenerationConfig.from_model_config(model.config)
        generation.save_pretrained(str(out))
