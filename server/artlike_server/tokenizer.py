"""The base model's tokenizer in the server process, for offline trajectories: without torch.

`AutoTokenizer` imports torch (its model mappings do), which the proxy never loads (memory, start-up, a
larger heap for the garbage collector on the request path; importing torch dominates the tokenizer's load
time). Every fast tokenizer is a `PreTrainedTokenizerFast` over `tokenizer.json`, with the same
special tokens and chat template from `tokenizer_config.json`, so that class loads it directly. Only a model
without `tokenizer.json` (a slow, sentencepiece-only tokenizer) falls back to `AutoTokenizer`, and says so.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def load_chat_tokenizer(model_path: Path | str) -> Any:
    path = Path(model_path)
    if (path / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(path))
    log.warning("%s has no tokenizer.json: loading its tokenizer with AutoTokenizer, which imports torch into "
                "the server process", model_path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path))


def decode_as_engine(tokenizer: Any, token_ids: list[int]) -> str:
    """The text vLLM returns for these output ids (special tokens skipped). Its detokenizer holds back a
    token whose bytes end inside a multi-byte character until a later token completes it, so an output cut
    off there (finish "length") ends before that whole token: with byte-level BPE one token can carry a
    space and the first bytes of an emoji (" \\xf0\\x9f"), and dropping only the U+FFFD would keep the space.
    The last tokens are dropped until the text ends in a whole character (at most three for UTF-8)."""
    end = len(token_ids)
    while True:
        text: str = tokenizer.decode(token_ids[:end], skip_special_tokens=True)
        if end == 0 or not text.endswith("\ufffd"):
            return text
        end -= 1
