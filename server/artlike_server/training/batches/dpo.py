"""DPO sequences of a request's preference pairs: each answer is one sequence, the chosen side `preference`
1 and the rejected -1, both with the pair's index as `group_index` (the trainer keeps a pair together)."""

from __future__ import annotations

from artlike.types import OfflineTrajectory, RecordedPair, TrainRequest

from ...errors import InvalidRequest
from ...trainer_ipc.sequences import SequenceBuildError, TrainSequence, sequences_from_completions
from . import Batch, BatchContext, Records


def build(request: TrainRequest, records: Records, context: BatchContext) -> Batch:
    sequences: list[TrainSequence] = []
    for index, pair in enumerate(request.pairs):
        name = f"pairs[{index}]"
        sides = []
        for side, preference in (("chosen", 1), ("rejected", -1)):
            if isinstance(pair, RecordedPair):
                trajectory_id, completion_id = (
                    (pair.chosen_trajectory_id, pair.chosen_completion_id) if preference == 1
                    else (pair.rejected_trajectory_id, pair.rejected_completion_id))
                try:
                    built = sequences_from_completions(
                        records[trajectory_id], 0.0, mask_truncated=False, group_index=index,
                        only=None if completion_id is None else [completion_id])
                except SequenceBuildError as error:
                    raise InvalidRequest(f"{name}.{side}: {error}", param=f"{name}.{side}_completion_id",
                                         code="completion_not_found") from None
            else:
                offline = OfflineTrajectory(messages=[*pair.prompt, *getattr(pair, side)], tools=pair.tools,
                                            reward=0.0)
                try:
                    built = context.tokenizer.offline_sequences(offline, 0.0, group_index=index,
                                                                context_messages=len(pair.prompt))
                except SequenceBuildError as error:
                    raise InvalidRequest(f"{name}.{side}: {error}", param=f"{name}.{side}",
                                         code="invalid_pair") from None
            if len(built) != 1:
                raise InvalidRequest(
                    f"{name}.{side} makes {len(built)} training sequences; each answer of a pair must be one "
                    "conversation whose turns extend each other token for token", param=f"{name}.{side}",
                    code="invalid_pair")
            context.check_lengths(built, f"{name}.{side}", f"{name}.{side}")
            built[0].preference = preference
            sides.append(built[0])
        chosen, rejected = sides
        if (chosen.token_ids, chosen.trainable) == (rejected.token_ids, rejected.trainable):
            raise InvalidRequest(f"{name}: the chosen and rejected answers are the same tokens",
                                 param=name, code="invalid_pair")
        sequences.extend(sides)
    return Batch(sequences=sequences)
