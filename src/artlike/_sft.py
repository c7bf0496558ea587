"""Supervised fine-tuning from the client: examples for `model.train_sft(...)`, and the best trajectories of
each group as examples (rejection sampling, "RFT")."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ._trajectory import Trajectory, TrajectoryGroup
from .types import MessagesExample, RecordedExample, SFTConfig, TrainConfig, TrainRequest

Example = Trajectory | Sequence[Mapping[str, Any]] | Mapping[str, Any]
"""A recorded or offline `Trajectory`, a list of chat messages, or `{"messages": [...], "tools": [...]}`."""


def to_example(example: Example) -> RecordedExample | MessagesExample:
    """The wire form of one SFT example (a recorded trajectory trains on its exact sampled tokens)."""
    if isinstance(example, Trajectory):
        if example.failed:
            raise ValueError(f"{example!r} failed and cannot be trained on")
        if example.recorded:
            return RecordedExample(trajectory_id=example.id)
        return MessagesExample(messages=example.messages(), tools=example.tools)
    if isinstance(example, Mapping):
        return MessagesExample.model_validate(dict(example))
    return MessagesExample(messages=[dict(message) for message in example])


def build_sft_request(model: str, examples: Iterable[Example], config: TrainConfig) -> TrainRequest:
    """The `/_train_model` body of an SFT job; raises ValueError before any request when there is nothing."""
    if not isinstance(config, SFTConfig):
        raise ValueError(f"train_sft needs an SFT config, not objective {config.objective!r}")
    wire = [to_example(example) for example in examples]
    if not wire:
        raise ValueError("nothing to train on: no examples")
    return TrainRequest(model=model, examples=wire, config=config)


def best_of_groups(
    groups: Iterable[TrajectoryGroup | Iterable[Trajectory]], *, top_k: int = 1, min_reward: float | None = None
) -> list[Trajectory]:
    """The `top_k` highest-rewarded trajectories of each group (ties: the earlier one), at least `min_reward`
    when given; failed and unrewarded trajectories never count. Feed them to `model.train_sft(...)`.

    >>> group = [Trajectory(reward=r, messages_and_choices=[{"role": "assistant", "content": str(r)}])
    ...          for r in (0.1, 0.9, 0.5)]
    >>> [t.reward for t in best_of_groups([group], top_k=2)]
    [0.9, 0.5]
    >>> best_of_groups([group], min_reward=1.0)
    []
    """
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    chosen: list[Trajectory] = []
    for group in groups:
        scored = [t for t in group if not t.failed and t.reward is not None]
        ranked = sorted(scored, key=lambda t: -(t.reward or 0.0))  # sorted() is stable: ties keep their order
        chosen.extend(t for t in ranked[:top_k] if min_reward is None or (t.reward or 0.0) >= min_reward)
    return chosen
