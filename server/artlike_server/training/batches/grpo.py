"""Sequences of rewarded groups for the group-relative objectives (grpo, cispo, gspo, importance_sampling):
each trajectory's advantage is its reward against its group's; a group whose rewards are all equal teaches
nothing and is skipped. PPO's builder (`ppo.py`) walks the groups the same way with advantages of 0."""

from __future__ import annotations

from collections.abc import Callable

from artlike.types import DPOConfig, OfflineTrajectory, PPOConfig, RewardModelConfig, SFTConfig, TrainRequest

from ...errors import InvalidRequest
from ...trainer_ipc.sequences import SequenceBuildError, TrainSequence, sequences_from_completions
from ..advantages import group_advantages, is_zero_variance
from . import Batch, BatchContext, Records

Advantages = Callable[[list[float]], list[float] | None]
"""A group's advantages from its rewards; None skips the group."""


def build(request: TrainRequest, records: Records, context: BatchContext) -> Batch:
    config = request.config
    assert not isinstance(config, SFTConfig | DPOConfig | RewardModelConfig | PPOConfig), "a group-relative one"
    scale, positive_weight = config.scale_rewards, config.positive_advantage_weight

    def relative(rewards: list[float]) -> list[float] | None:
        if is_zero_variance(rewards):
            return None
        return group_advantages(rewards, scale_rewards=scale, positive_weight=positive_weight)

    return build_groups(request, records, context, relative)


def build_groups(request: TrainRequest, records: Records, context: BatchContext, advantages_of: Advantages
                 ) -> Batch:
    """Each group's trajectories as sequences carrying their advantage and reward; a reward of None (PPO's
    reward model scores it) counts as 0 for the advantages and is left out of the reported rewards."""
    config = request.config
    assert not isinstance(config, SFTConfig | DPOConfig | RewardModelConfig), "they have their own builders"
    mask_truncated = config.mask_truncated
    batch = Batch(sequences=[])
    for group_index, group in enumerate(request.groups):
        group_rewards = [t.reward or 0.0 for t in group.trajectories]
        batch.rewards.extend(t.reward for t in group.trajectories if t.reward is not None)
        for t in group.trajectories:
            for key, value in t.metrics.items():
                batch.metrics.setdefault(key, []).append(value)
        advantages = advantages_of(group_rewards)
        if advantages is None:
            batch.groups_skipped += 1
            continue
        for index, (trajectory, advantage) in enumerate(zip(group.trajectories, advantages, strict=True)):
            item = f"groups[{group_index}].trajectories[{index}]"
            built: list[TrainSequence]
            if isinstance(trajectory, OfflineTrajectory):
                name = item
                try:
                    built = context.tokenizer.offline_sequences(trajectory, advantage, group_index=group_index)
                except SequenceBuildError as error:
                    raise InvalidRequest(f"offline trajectory {name}: {error}", param=name,
                                         code="invalid_trajectory") from None
            else:
                name = f"trajectory {trajectory.trajectory_id!r}"
                try:
                    built = sequences_from_completions(
                        records[trajectory.trajectory_id], advantage, mask_truncated=mask_truncated,
                        group_index=group_index, only=trajectory.completion_ids)
                except SequenceBuildError as error:
                    raise InvalidRequest(str(error), param=f"{item}.completion_ids",
                                         code="completion_not_found") from None
            context.check_lengths(built, name, item)
            for sequence in built:
                sequence.reward = group_rewards[index]
            batch.sequences.extend(s for s in built if s.num_trainable_tokens > 0)
    return batch
