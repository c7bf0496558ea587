"""A reward model's sequences: its preference pairs as DPO's, then its scored examples, each one whole
conversation carrying a target per objective of the reward head (NaN: unknown)."""

from __future__ import annotations

import math

from artlike.types import OfflineTrajectory, ScoredExample, TrainRequest

from ...errors import InvalidRequest
from ...trainer_ipc.sequences import SequenceBuildError, TrainSequence, sequences_from_completions
from . import Batch, BatchContext, Records, dpo


def build(request: TrainRequest, records: Records, context: BatchContext) -> Batch:
    sequences = dpo.build(request, records, context).sequences if request.pairs else []
    objectives = context.reward_objectives
    for index, example in enumerate(request.scored):
        name = f"scored[{index}]"
        if len(example.targets) != objectives:
            raise InvalidRequest(f"{name} has {len(example.targets)} target(s); the reward model has "
                                 f"{objectives} objective(s)", param=f"{name}.targets", code="invalid_targets")
        built = _scored_sequences(example, records, context, name, group_index=len(request.pairs) + index)
        context.check_lengths(built, name, name)
        sequence = built[-1]  # the whole conversation: later turns extend the earlier ones
        sequence.targets = [math.nan if t is None else t for t in example.targets]
        sequences.append(sequence)
    return Batch(sequences=sequences)


def _scored_sequences(example: ScoredExample, records: Records, context: BatchContext, name: str, *,
                      group_index: int) -> list[TrainSequence]:
    if example.trajectory_id is not None:
        try:
            built = sequences_from_completions(
                records[example.trajectory_id], 0.0, mask_truncated=False, group_index=group_index,
                only=None if example.completion_id is None else [example.completion_id])
        except SequenceBuildError as error:
            raise InvalidRequest(f"{name}: {error}", param=f"{name}.completion_id",
                                 code="completion_not_found") from None
    else:
        assert example.messages is not None
        offline = OfflineTrajectory(messages=example.messages, tools=example.tools, reward=0.0)
        try:
            built = context.tokenizer.offline_sequences(offline, 0.0, group_index=group_index)
        except (SequenceBuildError, ValueError) as error:
            raise InvalidRequest(f"{name}: {error}", param=f"{name}.messages", code="invalid_example") from None
    if not built:
        raise InvalidRequest(f"{name} has no assistant answer to score", param=name, code="invalid_example")
    return built
