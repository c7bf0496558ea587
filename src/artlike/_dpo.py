"""Preference optimisation from the client: pairs for `model.train_dpo(...)`, and pairs from rated rollouts."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import TypeAdapter

from ._trajectory import Trajectory, TrajectoryGroup
from .types import DPOConfig, MessagesPair, PreferencePair, RecordedPair, TrainConfig, TrainRequest

Pair = tuple[Trajectory, Trajectory] | Mapping[str, Any] | RecordedPair | MessagesPair
"""`(chosen, rejected)` recorded trajectories of the same prompt, or a wire pair as a dict:
`{"prompt": [...], "chosen": ..., "rejected": ...}` or `{"chosen_trajectory_id": ..., "rejected_trajectory_id": ...}`."""

_PAIR: TypeAdapter[RecordedPair | MessagesPair] = TypeAdapter(PreferencePair)


def to_pair(pair: Pair) -> RecordedPair | MessagesPair:
    """The wire form of one preference pair (recorded trajectories train on their exact sampled tokens)."""
    if isinstance(pair, RecordedPair | MessagesPair):
        return pair
    if isinstance(pair, Mapping):
        return _PAIR.validate_python(dict(pair))
    chosen, rejected = pair
    for trajectory in (chosen, rejected):
        if trajectory.failed:
            raise ValueError(f"{trajectory!r} failed and cannot be trained on")
        if not trajectory.recorded:
            raise ValueError(f"{trajectory!r} is offline: send the pair as {{'prompt', 'chosen', 'rejected'}} messages")
    return RecordedPair(chosen_trajectory_id=chosen.id, rejected_trajectory_id=rejected.id)


def build_dpo_request(model: str, pairs: Iterable[Pair], config: TrainConfig) -> TrainRequest:
    """The `/_train_model` body of a DPO job; raises ValueError before any request when there is nothing."""
    if not isinstance(config, DPOConfig):
        raise ValueError(f"train_dpo needs a DPO config, not objective {config.objective!r}")
    wire = [to_pair(pair) for pair in pairs]
    if not wire:
        raise ValueError("nothing to train on: no pairs")
    return TrainRequest(model=model, pairs=wire, config=config)


def preference_pairs(
    groups: Iterable[TrajectoryGroup | Iterable[Trajectory]], *, min_margin: float = 0.0
) -> list[tuple[Trajectory, Trajectory]]:
    """One `(chosen, rejected)` pair per group: its highest- and lowest-rewarded trajectories (ties: the
    earlier one), when their rewards differ by more than `min_margin`. Failed and unrewarded trajectories
    never count. Feed them to `model.train_dpo(...)`.

    >>> group = [Trajectory(reward=r, messages_and_choices=[{"role": "assistant", "content": str(r)}])
    ...          for r in (0.1, 0.9, 0.5)]
    >>> [(c.reward, r.reward) for c, r in preference_pairs([group])]
    [(0.9, 0.1)]
    >>> preference_pairs([group], min_margin=0.8)
    []
    """
    pairs: list[tuple[Trajectory, Trajectory]] = []
    for group in groups:
        scored = [t for t in group if not t.failed and t.reward is not None]
        if len(scored) < 2:
            continue
        ranked = sorted(scored, key=lambda t: -(t.reward or 0.0))  # stable: ties keep their order
        chosen, rejected = ranked[0], ranked[-1]
        if (chosen.reward or 0.0) - (rejected.reward or 0.0) > min_margin:
            pairs.append((chosen, rejected))
    return pairs
