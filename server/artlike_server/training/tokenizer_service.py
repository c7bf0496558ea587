"""The base model's tokenizer as one shared service: loaded lazily (only offline trajectories, the studio's
text, reward scoring of message lists and the tokenizer routes need it), used by one thread at a time, and rendering chats with
the template the engine serves with. Every method blocks: call it in a worker thread."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from artlike.types import OfflineTrajectory

from ..tokenizer import decode_as_engine
from ..trainer_ipc.sequences import SequenceBuildError, TrainSequence, sequences_from_offline


class TokenizerService:
    def __init__(self, load: Callable[[], Any], chat_template: str | None = None) -> None:
        self._load = load  # returns the same tokenizer on every call (cached by the caller)
        self.chat_template = chat_template
        self._lock = threading.Lock()

    def load(self) -> None:
        """Load the tokenizer now (at start-up), so the first request that needs it does not pay for it
        while requests are in flight."""
        with self._lock:
            self._load()

    def decode(self, token_ids: list[int]) -> list[str]:
        """Each token's text."""
        with self._lock:
            tokenizer = self._load()
            return [tokenizer.decode([token_id]) for token_id in token_ids]

    def decode_text(self, token_ids: list[int]) -> str:
        """The text of a token sequence without special tokens, as the engine returned it (see
        `decode_as_engine` for an output cut off inside a character)."""
        with self._lock:
            return decode_as_engine(self._load(), token_ids)

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """The token ids of `text` (with the tokenizer's special tokens around it when asked)."""
        with self._lock:
            ids: list[int] = self._load().encode(text, add_special_tokens=add_special_tokens)
            return ids

    def detokenize(self, token_ids: list[int]) -> str:
        """The text of a token sequence, special tokens included (the inverse of `encode`)."""
        with self._lock:
            text: str = self._load().decode(token_ids)
            return text

    def info(self) -> dict[str, Any]:
        """The special tokens and the chat template the engine serves with: what a client that tokenizes
        for itself needs."""
        with self._lock:
            tokenizer = self._load()
            return {"tokenizer_class": type(tokenizer).__name__, "eos_token": tokenizer.eos_token,
                    "bos_token": tokenizer.bos_token, "pad_token": tokenizer.pad_token,
                    "unk_token": tokenizer.unk_token, "chat_template": self.chat_template or tokenizer.chat_template,
                    "vocab_size": len(tokenizer)}

    def offline_sequences(self, trajectory: OfflineTrajectory, advantage: float, *, group_index: int = 0,
                          last_turn_only: bool = False, context_messages: int = 0) -> list[TrainSequence]:
        """`sequences_from_offline` with this tokenizer and the served chat template. Raises
        SequenceBuildError."""
        with self._lock:
            return sequences_from_offline(trajectory, self._load(), advantage, chat_template=self.chat_template,
                                          group_index=group_index, last_turn_only=last_turn_only,
                                          context_messages=context_messages)

    def conversation_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        """The token ids of a conversation that ends with an assistant answer, as training renders it.
        Raises SequenceBuildError."""
        built = self.offline_sequences(OfflineTrajectory(messages=messages, tools=tools), 0.0)
        if not built:
            raise SequenceBuildError("the conversation has no assistant answer")
        return built[-1].token_ids
