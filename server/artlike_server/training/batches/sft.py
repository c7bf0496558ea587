"""SFT sequences of a request's examples: recorded ones train on their exact sampled tokens, message lists
are rendered with the served chat template."""

from __future__ import annotations

from artlike.types import OfflineTrajectory, RecordedExample, SFTConfig, TrainRequest

from ...errors import InvalidRequest
from ...trainer_ipc.sequences import SequenceBuildError, sequences_from_completions
from . import Batch, BatchContext, Records


def build(request: TrainRequest, records: Records, context: BatchContext) -> Batch:
    assert isinstance(request.config, SFTConfig)
    last_only = request.config.assistant_turns == "last"
    batch = Batch(sequences=[])
    for index, example in enumerate(request.examples):
        name = f"examples[{index}]"
        if isinstance(example, RecordedExample):
            built = sequences_from_completions(records[example.trajectory_id], 1.0, mask_truncated=False,
                                               group_index=index, last_turn_only=last_only)
        else:
            offline = OfflineTrajectory(messages=example.messages, tools=example.tools, reward=0.0)
            try:
                built = context.tokenizer.offline_sequences(offline, 1.0, group_index=index,
                                                            last_turn_only=last_only)
            except SequenceBuildError as error:
                raise InvalidRequest(f"{name}: {error}", param=name, code="invalid_example") from None
        context.check_lengths(built, name, name)
        batch.sequences.extend(s for s in built if s.num_trainable_tokens > 0)
    return batch
