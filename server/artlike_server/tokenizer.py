"""The base model's tokenizer in the server process, for offline trajectories: without torch.

`AutoTokenizer` imports torch (its model mappings do), which the proxy never loads (memory, start-up, a
larger heap for the garbage collector on the request path; measured: `import` plus load 6.3 s with torch,
1.1 s without). Every fast tokenizer is a `PreTrainedTokenizerFast` over `tokenizer.json`, with the same
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
