"""Sequences of PPO's groups: no group baseline (the value head is the baseline), so every trajectory
trains, with an advantage of 0 here; the trainer computes GAE advantages from its reward and values."""

from __future__ import annotations

from artlike.types import TrainRequest

from . import Batch, BatchContext, Records
from .grpo import build_groups


def build(request: TrainRequest, records: Records, context: BatchContext) -> Batch:
    return build_groups(request, records, context, lambda rewards: [0.0] * len(rewards))
