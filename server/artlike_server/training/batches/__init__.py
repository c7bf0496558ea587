"""A `/_train_model` request's training sequences, one builder per objective (mirroring
`trainer/objectives/`): each turns the request's data — recorded completions read from the log, offline
messages rendered with the served chat template — into `TrainSequence`s, and refuses what cannot train with
a 400 naming the item. Builders run in a worker thread (tokenizing is CPU work).

    module      objectives                                   data
    grpo.py     grpo, cispo, gspo, importance_sampling       rewarded `groups` (group-relative advantages)
    ppo.py      ppo                                          `groups` (the value head is the baseline)
    sft.py      sft                                          `examples`
    dpo.py      dpo                                          preference `pairs`
    reward.py   reward_model                                 `pairs` and/or `scored` examples
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from artlike.types import DPOConfig, PPOConfig, RewardModelConfig, SFTConfig, TrainRequest

from ...errors import InvalidRequest
from ...trainer_ipc.sequences import TrainSequence
from ..tokenizer_service import TokenizerService

Records = dict[str, list[Any]]
"""Recorded completions by trajectory id, as `CompletionLog.read_for_training` returns them."""


@dataclass
class Batch:
    sequences: list[TrainSequence]
    groups_skipped: int = 0
    rewards: list[float] = field(default_factory=list)
    metrics: dict[str, list[float]] = field(default_factory=dict)  # each trajectory metric's values


@dataclass(frozen=True)
class BatchContext:
    """What a builder needs beyond the request and its records."""

    tokenizer: TokenizerService
    max_sequence_tokens: int
    reward_objectives: int = 1  # a reward model's head: one target per objective

    def check_lengths(self, built: list[TrainSequence], name: str, param: str) -> None:
        for sequence in built:
            if sequence.num_tokens > self.max_sequence_tokens:
                raise InvalidRequest(
                    f"{name} makes a training sequence of {sequence.num_tokens} tokens, over this "
                    f"server's limit of {self.max_sequence_tokens} (--max-sequence-tokens)",
                    param=param, code="sequence_too_long")


Builder = Callable[[TrainRequest, Records, BatchContext], Batch]


def builder_for(request: TrainRequest) -> Builder:
    """The builder of the request's objective."""
    from . import dpo, grpo, ppo, reward, sft

    config = request.config
    if isinstance(config, RewardModelConfig):
        return reward.build
    if isinstance(config, SFTConfig):
        return sft.build
    if isinstance(config, DPOConfig):
        return dpo.build
    if isinstance(config, PPOConfig):
        return ppo.build
    return grpo.build
