"""The server's text for recorded output ids is the text vLLM returned for them, also when sampling stopped
inside a multi-byte character (CI once saw "... Nyx-9. " against the engine's "... Nyx-9.": SmolLM2 has one
token for a space and an emoji's first bytes)."""

from __future__ import annotations

from functools import cache
from typing import Any

from artlike_server.default_model import ensure_default_model
from artlike_server.tokenizer import decode_as_engine, load_chat_tokenizer

SENTENCE = "Bye, have a seat on the planet of Nyx-9. \N{EARTH GLOBE EUROPE-AFRICA} Goodbye"


@cache
def tokenizer() -> Any:
    return load_chat_tokenizer(ensure_default_model())


def test_a_whole_output_decodes_as_the_tokenizer_does() -> None:
    ids = tokenizer().encode(SENTENCE, add_special_tokens=False)
    eos = tokenizer().eos_token_id
    assert decode_as_engine(tokenizer(), [*ids, eos]) == SENTENCE  # the sampled EOS is no text


def test_an_output_cut_inside_a_character_ends_before_the_token_that_started_it() -> None:
    ids = tokenizer().encode(SENTENCE, add_special_tokens=False)
    before_emoji = tokenizer().encode("Bye, have a seat on the planet of Nyx-9.", add_special_tokens=False)
    emoji_tokens = [tokenizer().decode([i]) for i in ids[len(before_emoji):]][:3]
    assert emoji_tokens[0].startswith(" ") and emoji_tokens[0].endswith("\ufffd")  # space + first bytes
    assert tokenizer().decode(ids[:len(before_emoji) + 1]).endswith(". \ufffd")  # why a plain strip fails
    for cut in range(len(before_emoji) + 1, len(before_emoji) + 3):  # inside the emoji: held back whole
        assert decode_as_engine(tokenizer(), ids[:cut]) == "Bye, have a seat on the planet of Nyx-9."
    emoji_ends = len(tokenizer().encode(SENTENCE.removesuffix(" Goodbye"), add_special_tokens=False))
    assert decode_as_engine(tokenizer(), ids[:emoji_ends]) == SENTENCE.removesuffix(" Goodbye")


def test_nothing_but_an_unfinished_character_is_no_text() -> None:
    ids = tokenizer().encode("\N{EARTH GLOBE EUROPE-AFRICA}", add_special_tokens=False)
    assert len(ids) > 1
    assert decode_as_engine(tokenizer(), ids[:1]) == ""
    assert decode_as_engine(tokenizer(), []) == ""
