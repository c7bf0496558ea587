"""Off-policy guidance for a managed job: a row's reference answer joins a group whose rollouts all failed.

GRPO learns nothing from a group whose rewards are equal; a row the policy fails every time stays failed.
With `remedies.guide_field`, each such group gets one more trajectory: the row's reference answer (that field
of the row) as the assistant's message, scored by the job's own reward in the sandbox. It joins only when
that score reaches the pass threshold, so a reference the reward does not accept (a different format, a
wrong field) never teaches; the job's events say so. The client's `PipelineTrainer(guide=...)` is the same
remedy for a loop of one's own.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import artlike as art

from .datasets import PromptRow
from .rewards import JobReward

ROW_METADATA = "row"  # a rollout's metadata key: the line of the row it answers
GUIDE_METADATA = "guide"  # a trajectory's metadata key: the row's reference, not a rollout


@dataclass
class Guided:
    groups: list[art.TrajectoryGroup]  # in the order given, guided ones with their reference last
    guided: int = 0  # groups a reference joined
    refused: list[str] = field(default_factory=list)  # why a reference did not join, one line per row


def reference_text(value: Any) -> str | None:
    """A row field's value as the assistant's answer: text as it is, numbers and structures as JSON; None
    for a missing or empty value.

    >>> reference_text("42"), reference_text(42), reference_text({"a": 1}), reference_text(""), reference_text(None)
    ('42', '42', '{"a": 1}', None, None)
    """
    if value is None or value == "":
        return None
    return value if isinstance(value, str) else json.dumps(value)


def failed_every_rollout(group: art.TrajectoryGroup, pass_threshold: float) -> bool:
    """No rollout of the group reached the pass threshold (an unscored one does not pass).

    >>> failed_every_rollout(art.TrajectoryGroup([art.Trajectory(reward=0.1), art.Trajectory(reward=0.0)]), 0.5)
    True
    >>> failed_every_rollout(art.TrajectoryGroup([art.Trajectory(reward=0.1), art.Trajectory(reward=0.5)]), 0.5)
    False
    """
    return bool(group.trajectories) and not any(
        t.reward is not None and t.reward >= pass_threshold for t in group.trajectories)


async def guide_groups(groups: Sequence[art.TrajectoryGroup], rows: Mapping[int, PromptRow], guide_field: str,
                       reward: JobReward, pass_threshold: float) -> Guided:
    """Each group whose rollouts all failed, with its row's reference answer added when the job's reward
    passes it. `rows` maps a row's line to the row; each rollout names its row in `metadata["row"]`."""
    result = Guided(groups=[])
    for group in groups:
        if not failed_every_rollout(group, pass_threshold):
            result.groups.append(group)
            continue
        row = rows[group.trajectories[0].metadata[ROW_METADATA]]
        answer = reference_text(row.item.get(guide_field))
        if answer is None:
            result.refused.append(f"row {row.line} has no {guide_field!r}")
            result.groups.append(group)
            continue
        completion = [{"role": "assistant", "content": answer}]
        score = await reward.score(completion, row.item)
        if score.error is not None or score.value < pass_threshold:
            why = (f"the reward failed on it: {score.error.splitlines()[0]}" if score.error else
                   f"it scores {score.value:g}, under the pass threshold {pass_threshold:g}")
            result.refused.append(f"row {row.line}: its {guide_field!r} was not used: {why}")
            result.groups.append(group)
            continue
        reference = art.Trajectory([*row.messages, *completion], reward=score.value, tools=row.tools,
                                   metadata={GUIDE_METADATA: True, ROW_METADATA: row.line})
        result.groups.append(art.TrajectoryGroup([*group.trajectories, reference], exceptions=group.exceptions))
        result.guided += 1
    return result
