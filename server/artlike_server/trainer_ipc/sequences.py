"""Token-exact training sequences from recorded completions or offline chat messages.

A `TrainSequence` is what the trainer sees: token ids, which of them the model sampled (trainable), the
behaviour logprob of each sampled token, and the advantage of its trajectory. Per-token lists are aligned
to `token_ids`: entry t describes token t, which the model predicted from tokens 0..t-1.

Multi-turn merging, by exact token-id prefix and nothing fuzzier: turns are taken in order;
when a turn's prompt ids start with all the ids of a sequence built so far (its prompts and outputs), the
turn extends that sequence: the new part of the prompt (tool results, the next user message, template
scaffolding) is context, the new output is trainable. Otherwise the turn starts its own sequence, which
carries the same advantage. With ChatML an assistant turn's sampled ids end with `<|im_end|>` (vLLM keeps the
EOS token it stopped on in the output ids) and the next prompt continues `<|im_end|>`, `\n`, ... so a
well-behaved multi-turn trajectory becomes one sequence; a turn whose history was re-tokenized differently
(or edited by the agent) becomes a separate sequence instead of training on tokens the model never saw.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from artlike.types import CompletionRecord, OfflineTrajectory

UNKNOWN_LOGPROB = math.nan
"""Behaviour logprob of a sampled token whose sampling logprob is unknown: trained as on-policy (ratio 1)."""


class SequenceBuildError(ValueError):
    """A completion or offline message cannot be turned into a training sequence (inconsistent lengths...)."""


@dataclass(slots=True)
class TrainSequence:
    token_ids: list[int]
    trainable: list[bool]  # per token: True where the model sampled it
    behaviour_logprobs: list[float]  # per token: sampling logprob; 0.0 where not trainable, NaN when unknown
    advantage: float
    trajectory_id: str = ""
    group_index: int = 0  # the group (or, for a preference pair, the pair) the sequence belongs to
    preference: int = 0  # DPO: 1 the chosen side of pair `group_index`, -1 the rejected side, 0 not in a pair
    reward: float = 0.0  # PPO: the trajectory's own reward, given at the sequence's last sampled token
    targets: list[float] | None = None  # reward model: a target score per objective (NaN: unknown)
    # Per token, aligned like `behaviour_logprobs`: target t's own coefficient (Tinker's per-token `weights` or
    # `advantages`, `objectives/tinker.py`), in place of the sequence's `advantage`; entry 0 unused (0.0).
    token_advantages: list[float] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_trainable_tokens(self) -> int:
        return sum(self.trainable)


@dataclass(frozen=True, slots=True)
class Turn:
    """One model call: the prompt it saw, what it sampled, and whether to train on that output."""

    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    output_logprobs: Sequence[float]
    trainable: bool = True


@dataclass(slots=True)
class _Builder:
    token_ids: list[int] = field(default_factory=list)
    trainable: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    def append(self, ids: Sequence[int], trainable: bool, logprobs: Sequence[float] | None = None) -> None:
        self.token_ids.extend(ids)
        self.trainable.extend([trainable] * len(ids))
        self.logprobs.extend(logprobs if trainable and logprobs is not None else [0.0] * len(ids))


def merge_turns(
    turns: Iterable[Turn], advantage: float, *, trajectory_id: str = "", group_index: int = 0
) -> list[TrainSequence]:
    """Merge turns (in the order given) into sequences by exact prefix; drop sequences with nothing to train."""
    builders: list[_Builder] = []
    for turn in turns:
        if len(turn.output_logprobs) != len(turn.output_ids):
            raise SequenceBuildError(
                f"{len(turn.output_ids)} output tokens but {len(turn.output_logprobs)} logprobs"
            )
        prompt = list(turn.prompt_ids)
        # The longest prefix wins: after A then A+B, a turn continuing A+B must extend that sequence.
        candidates = [
            b
            for b in builders
            if len(b.token_ids) <= len(prompt) and prompt[: len(b.token_ids)] == b.token_ids
        ]
        target = max(candidates, key=lambda b: len(b.token_ids), default=None)
        if target is None:
            target = _Builder()
            builders.append(target)
        target.append(prompt[len(target.token_ids) :], trainable=False)
        target.append(turn.output_ids, trainable=turn.trainable, logprobs=turn.output_logprobs)
    for b in builders:
        if b.trainable[:1] == [True]:  # the first token has no context to be predicted from
            b.trainable[0], b.logprobs[0] = False, 0.0
    return [
        TrainSequence(
            token_ids=b.token_ids,
            trainable=b.trainable,
            behaviour_logprobs=b.logprobs,
            advantage=advantage,
            trajectory_id=trajectory_id,
            group_index=group_index,
        )
        for b in builders
        if any(b.trainable)
    ]


def sequences_from_completions(
    completions: Sequence[CompletionRecord],
    advantage: float,
    *,
    mask_truncated: bool,
    group_index: int = 0,
    last_turn_only: bool = False,
    only: Collection[int] | None = None,
) -> list[TrainSequence]:
    """Sequences of one recorded trajectory, its completions taken in the order they were recorded.

    `mask_truncated` keeps completions that hit max_tokens (finish_reason "length") only as context;
    `last_turn_only` keeps every completion but the last as context; `only` (completion ids) trains just
    those completions: earlier ones stay as context, later ones are left out.
    """
    ordered = sorted(completions, key=lambda c: (c.created_at, c.id))
    if only is not None:
        selected = set(only)
        missing = selected - {c.id for c in ordered}
        if missing:
            raise SequenceBuildError(f"completion(s) {sorted(missing)} are not part of trajectory "
                                     f"{ordered[0].trajectory_id if ordered else '?'!r}")
        last = max(index for index, c in enumerate(ordered) if c.id in selected)
        ordered = ordered[:last + 1]
    turns = [
        Turn(
            prompt_ids=c.prompt_token_ids,
            output_ids=c.output_token_ids,
            output_logprobs=c.logprobs,
            trainable=not (mask_truncated and c.finish_reason == "length")
            and not (last_turn_only and index < len(ordered) - 1)
            and (only is None or c.id in selected),
        )
        for index, c in enumerate(ordered)
    ]
    trajectory_id = ordered[0].trajectory_id if ordered else ""
    return merge_turns(turns, advantage, trajectory_id=trajectory_id, group_index=group_index)


class ChatTokenizer(Protocol):
    """The part of a transformers tokenizer the offline path uses."""

    eos_token_id: int | None

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, **kwargs: Any) -> list[int]: ...


def sequences_from_offline(
    trajectory: OfflineTrajectory,
    tokenizer: ChatTokenizer,
    advantage: float,
    *,
    chat_template: str | None = None,
    group_index: int = 0,
    last_turn_only: bool = False,
    context_messages: int = 0,
) -> list[TrainSequence]:
    """Sequences of an offline trajectory: every assistant message is a turn, trained on its tokens
    (`last_turn_only`: the last assistant message only; `context_messages`: none of the first N messages;
    the others are context).

    The prompt of assistant message i is the chat template applied to messages[:i] with the generation
    prompt. Its output ids are the message's `token_ids` when given; otherwise what the chat template renders
    for that message up to and including the EOS token (this covers tool calls), falling back to its content
    tokens + EOS when the template does not render the history as a prefix. `logprobs`, when given, must
    align with those ids; without them the tokens are trained as on-policy. `chat_template` overrides the
    tokenizer's: pass the template the engine serves with, so prompts match what the model sees online.
    """
    messages = trajectory.messages
    turns = []
    for index, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        prompt_ids = _render(
            tokenizer, messages[:index], trajectory.tools, chat_template, add_generation_prompt=True
        )
        output_ids = _output_ids(tokenizer, messages, index, trajectory.tools, chat_template, prompt_ids)
        logprobs = message.get("logprobs")
        if logprobs is None:
            output_logprobs = [UNKNOWN_LOGPROB] * len(output_ids)
        elif isinstance(logprobs, list) and all(isinstance(x, int | float) for x in logprobs):
            output_logprobs = [float(x) for x in logprobs]
        else:
            raise SequenceBuildError(f"messages[{index}].logprobs must be a list of numbers")
        if len(output_logprobs) != len(output_ids):
            raise SequenceBuildError(
                f"messages[{index}] has {len(output_ids)} tokens but {len(output_logprobs)} logprobs"
                + ("" if "token_ids" in message else " (send token_ids with logprobs)")
            )
        turns.append(Turn(prompt_ids=prompt_ids, output_ids=output_ids, output_logprobs=output_logprobs,
                          trainable=index >= context_messages))
    if last_turn_only:
        turns = [Turn(t.prompt_ids, t.output_ids, t.output_logprobs, trainable=i == len(turns) - 1)
                 for i, t in enumerate(turns)]
    return merge_turns(turns, advantage, group_index=group_index)


def _output_ids(
    tokenizer: ChatTokenizer,
    messages: Sequence[Mapping[str, Any]],
    index: int,
    tools: list[dict[str, Any]] | None,
    chat_template: str | None,
    prompt_ids: list[int],
) -> list[int]:
    message = messages[index]
    token_ids = message.get("token_ids")
    if token_ids is not None:
        if not isinstance(token_ids, list) or not all(isinstance(t, int) for t in token_ids):
            raise SequenceBuildError(f"messages[{index}].token_ids must be a list of integers")
        return token_ids
    eos = tokenizer.eos_token_id
    if eos is None:
        raise SequenceBuildError("the tokenizer has no EOS token; send token_ids with assistant messages")
    with_turn = _render(tokenizer, messages[: index + 1], tools, chat_template, add_generation_prompt=False)
    rendered = with_turn[len(prompt_ids) :]
    if with_turn[: len(prompt_ids)] == prompt_ids and eos in rendered:
        # Keep up to the EOS the model would have stopped on; what follows it is template scaffolding.
        return rendered[: len(rendered) - rendered[::-1].index(eos)]
    content = message.get("content")
    if not isinstance(content, str):
        raise SequenceBuildError(f"messages[{index}] has no token_ids and no text content to tokenize")
    return [*tokenizer.encode(content, add_special_tokens=False), eos]


def _render(
    tokenizer: ChatTokenizer,
    messages: Sequence[Mapping[str, Any]],
    tools: list[dict[str, Any]] | None,
    chat_template: str | None,
    *,
    add_generation_prompt: bool,
) -> list[int]:
    ids = tokenizer.apply_chat_template(
        list(messages),
        tools=tools,
        chat_template=chat_template,
        add_generation_prompt=add_generation_prompt,
        tokenize=True,
        return_dict=False,
    )
    return list(ids)
