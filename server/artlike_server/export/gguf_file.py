"""The `gguf` format: the merged model written as one GGUF file with llama.cpp's own gguf-py, the way
llama.cpp's `convert_hf_to_gguf.py` writes a Llama: its tensor names (gguf's name map), Q and K weights
permuted for llama.cpp's rotary layout, norms kept in float32, a gpt2-style BPE tokenizer (tokens, types,
merges, special ids) and the chat template in the metadata.

Only the Llama architecture is written (the embedded model is one); another architecture is refused with
a pointer to llama.cpp's converter, which reads the `merged` export.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from transformers import AutoTokenizer

from ..errors import InvalidRequest
from .formats import GgufType
from .merged import merged_model
from .source import StepSource

_TENSOR_TYPES: dict[str, gguf.GGMLQuantizationType] = {
    "f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
    "bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0,
}
_FILE_TYPES: dict[str, gguf.LlamaFileType] = {
    "f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
    "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
}
# llama.cpp picks its pre-tokenizer by a hash of the tokenizer's output on a probe text; these bases are
# known here by name. Others get "default", which llama.cpp loads with a warning.
_PRE_TOKENIZERS = {"HuggingFaceTB/SmolLM2": "smollm", "HuggingFaceTB/SmolLM": "smollm"}


def gguf_file_name(source: StepSource, quant: GgufType) -> str:
    return f"{source.name}-step{source.step}-{quant}.gguf"


def write_gguf(source: StepSource, out: Path, quant: GgufType) -> Path:
    model = merged_model(source, torch.float32)
    config = model.config
    if config.model_type != "llama":
        raise InvalidRequest(f"GGUF export writes the llama architecture only, not {config.model_type!r}; "
                             "convert the merged export with llama.cpp's convert_hf_to_gguf.py",
                             param="format", code="unsupported_export")
    if _rope(config).get("rope_type", "default") != "default":
        raise InvalidRequest("GGUF export does not write rope scaling; convert the merged export with "
                             "llama.cpp's convert_hf_to_gguf.py", param="format", code="unsupported_export")
    path = out / gguf_file_name(source, quant)
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
    writer.add_name(f"{source.name} step {source.step}")
    _write_hyperparameters(writer, config, quant)
    _write_tokenizer(writer, source, config.vocab_size)
    _write_tensors(writer, model.state_dict(), config, quant)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_hyperparameters(writer: gguf.GGUFWriter, config: Any, quant: GgufType) -> None:
    heads = config.num_attention_heads
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.num_key_value_heads or heads)
    theta: Any = _rope(config).get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0
    writer.add_rope_freq_base(float(theta))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(getattr(config, "head_dim", None) or config.hidden_size // heads)
    writer.add_file_type(_FILE_TYPES[quant])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _rope(config: Any) -> dict[str, Any]:
    """The rotary embedding's parameters (`rope_parameters`; older configs: `rope_scaling` and `rope_theta`)."""
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return {"rope_type": parameters.get("rope_type", parameters.get("type", "default")), **parameters}


def _write_tokenizer(writer: gguf.GGUFWriter, source: StepSource, vocab_size: int) -> None:
    """The vocabulary as llama.cpp's converter writes a gpt2-style BPE tokenizer (`get_vocab_base`)."""
    tokenizer: Any = AutoTokenizer.from_pretrained(str(source.base_path))
    if not getattr(tokenizer, "is_fast", False) or tokenizer.backend_tokenizer.model.__class__.__name__ != "BPE":
        raise InvalidRequest("GGUF export writes byte-level BPE tokenizers only; convert the merged export with "
                             "llama.cpp's convert_hf_to_gguf.py", param="format", code="unsupported_export")
    by_id = {index: token for token, index in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens: list[str] = []
    types: list[int] = []
    for index in range(vocab_size):
        token = by_id.get(index)
        if token is None:
            tokens.append(f"[PAD{index}]")
            types.append(gguf.TokenType.UNUSED)
        elif index in added:
            tokens.append(token)
            types.append(gguf.TokenType.CONTROL if added[index].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(token)
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    pre = next((name for prefix, name in _PRE_TOKENIZERS.items() if source.base_model_id.startswith(prefix)),
               "default")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(source.base_path, load_merges=True, n_vocab=vocab_size)
    if "bos" not in special.add_special_token:  # llama.cpp would add one to a BPE vocabulary: say what the tokenizer does
        bos = tokenizer.bos_token_id
        special.add_special_token["bos"] = bos is not None and tokenizer("a")["input_ids"][:1] == [bos]
    special.add_to_gguf(writer, quiet=True)  # merges, special token ids, add_bos/eos flags, chat template


def _permute(weights: np.ndarray[Any, Any], heads: int) -> np.ndarray[Any, Any]:
    """llama.cpp's rotary layout for Q/K rows (`LlamaModel.permute` in convert_hf_to_gguf.py)."""
    return (weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _write_tensors(writer: gguf.GGUFWriter, state: dict[str, torch.Tensor], config: Any, quant: GgufType) -> None:
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    for hf_name, tensor in state.items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # llama.cpp reuses token_embd for the output
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise InvalidRequest(f"GGUF export cannot map tensor {hf_name!r}", param="format",
                                 code="unsupported_export")
        data = tensor.detach().float().cpu().numpy()
        if hf_name.endswith("q_proj.weight"):
            data = _permute(data, heads)
        elif hf_name.endswith("k_proj.weight"):
            data = _permute(data, kv_heads)
        _add_tensor(writer, name, data, quant)


def _add_tensor(writer: gguf.GGUFWriter, name: str, data: np.ndarray[Any, Any], quant: GgufType) -> None:
    kind = _TENSOR_TYPES[quant]
    if data.ndim <= 1:
        kind = gguf.GGMLQuantizationType.F32  # norms and biases stay float32, as llama.cpp keeps them
    elif kind == gguf.GGMLQuantizationType.Q8_0 and data.shape[-1] % gguf.GGML_QUANT_SIZES[kind][0] != 0:
        kind = gguf.GGMLQuantizationType.F16  # rows that do not fill whole blocks (llama.cpp falls back too)
    if kind == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, data.astype(np.float32))
    elif kind == gguf.GGMLQuantizationType.F16:
        writer.add_tensor(name, data.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
