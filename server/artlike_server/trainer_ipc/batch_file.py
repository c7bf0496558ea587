"""The training batch on disk, handed from the server to the trainer worker: one safetensors file.

Sequences are concatenated into flat arrays with offsets (safetensors holds only tensors and a str→str
metadata map; no pickle). float32 keeps NaN, which marks unknown behaviour logprobs.

    token_ids           int64   [total_tokens]
    trainable           uint8   [total_tokens]
    behaviour_logprobs  float32 [total_tokens]
    offsets             int64   [num_sequences + 1]   sequence i is [offsets[i], offsets[i+1])
    advantages          float64 [num_sequences]
    group_indices       int64   [num_sequences]
    preferences         int8    [num_sequences]       DPO: 1 chosen, -1 rejected, 0 not in a pair
    rewards             float64 [num_sequences]       PPO: the trajectory's reward (optional)
    targets             float32 [num_sequences, K]    reward model: target scores, NaN unknown (optional)
    token_advantages    float32 [total_tokens]        per-token coefficients, NaN in sequences without (optional)
    metadata["trajectory_ids"]  JSON list of str
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import orjson
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from artlike_server.trainer_ipc.sequences import TrainSequence

FORMAT = "artlike-train-batch/1"


class BatchFileError(ValueError):
    """The batch file is not a valid training batch."""


def write_batch(path: Path, sequences: Sequence[TrainSequence]) -> None:
    """Write atomically (temporary file, then rename), so the worker never reads half a batch."""
    for index, s in enumerate(sequences):
        if not len(s.token_ids) == len(s.trainable) == len(s.behaviour_logprobs):
            raise BatchFileError(
                f"sequence {index}: trainable and behaviour_logprobs must align with token_ids"
            )
        if s.token_advantages is not None and len(s.token_advantages) != len(s.token_ids):
            raise BatchFileError(f"sequence {index}: token_advantages must align with token_ids")
    lengths = np.array([s.num_tokens for s in sequences], dtype=np.int64)
    offsets = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(lengths, dtype=np.int64)])
    tensors = {
        "token_ids": np.array([t for s in sequences for t in s.token_ids], dtype=np.int64),
        "trainable": np.array([m for s in sequences for m in s.trainable], dtype=np.uint8),
        "behaviour_logprobs": np.array(
            [x for s in sequences for x in s.behaviour_logprobs], dtype=np.float32
        ),
        "offsets": offsets,
        "advantages": np.array([s.advantage for s in sequences], dtype=np.float64),
        "group_indices": np.array([s.group_index for s in sequences], dtype=np.int64),
        "preferences": np.array([s.preference for s in sequences], dtype=np.int8),
        "rewards": np.array([s.reward for s in sequences], dtype=np.float64),
    }
    width = max((len(s.targets) for s in sequences if s.targets is not None), default=0)
    if width:
        targets = np.full((len(sequences), width), np.nan, dtype=np.float32)
        for row, s in enumerate(sequences):
            if s.targets is not None:
                targets[row, : len(s.targets)] = s.targets
        tensors["targets"] = targets
    if any(s.token_advantages is not None for s in sequences):
        tensors["token_advantages"] = np.array(
            [x for s in sequences
             for x in (s.token_advantages if s.token_advantages is not None else [math.nan] * s.num_tokens)],
            dtype=np.float32,
        )
    metadata = {
        "format": FORMAT,
        "trajectory_ids": orjson.dumps([s.trajectory_id for s in sequences]).decode(),
    }
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file(tensors, str(tmp), metadata=metadata)
    tmp.replace(path)


def read_batch(path: Path) -> list[TrainSequence]:
    with safe_open(str(path), framework="numpy") as handle:
        metadata = handle.metadata() or {}
    if metadata.get("format") != FORMAT:
        raise BatchFileError(f"{path} is not a {FORMAT} file (format={metadata.get('format')!r})")
    arrays = load_file(str(path))
    offsets = arrays["offsets"].tolist()
    trajectory_ids = orjson.loads(metadata["trajectory_ids"])
    count = len(offsets) - 1
    preferences = arrays.get("preferences", np.zeros(count, dtype=np.int8))
    rewards = arrays.get("rewards", np.zeros(count, dtype=np.float64))
    targets = arrays.get("targets")
    token_advantages = arrays.get("token_advantages")
    if token_advantages is not None and len(token_advantages) != offsets[-1]:
        raise BatchFileError(f"{path}: token_advantages do not align with token_ids")
    if not (len(arrays["advantages"]) == len(arrays["group_indices"]) == len(preferences) == len(rewards)
            == len(trajectory_ids) == count) or (targets is not None and len(targets) != count):
        raise BatchFileError(f"{path}: per-sequence arrays disagree on the number of sequences")
    token_ids = arrays["token_ids"].tolist()
    trainable = arrays["trainable"].astype(bool).tolist()
    logprobs = arrays["behaviour_logprobs"].astype(np.float64).tolist()
    return [
        TrainSequence(
            token_ids=token_ids[offsets[i] : offsets[i + 1]],
            trainable=trainable[offsets[i] : offsets[i + 1]],
            behaviour_logprobs=logprobs[offsets[i] : offsets[i + 1]],
            advantage=float(arrays["advantages"][i]),
            trajectory_id=trajectory_ids[i],
            group_index=int(arrays["group_indices"][i]),
            preference=int(preferences[i]),
            reward=float(rewards[i]),
            targets=None if targets is None or np.isnan(targets[i]).all() else targets[i].astype(np.float64).tolist(),
            token_advantages=_per_token(token_advantages, offsets[i], offsets[i + 1]),
        )
        for i in range(count)
    ]


def _per_token(values: np.ndarray | None, start: int, end: int) -> list[float] | None:
    """One sequence's slice of an optional per-token array; None when absent or all NaN (the sequence had none)."""
    if values is None or start == end or np.isnan(values[start:end]).all():
        return None
    per_token: list[float] = values[start:end].astype(np.float64).tolist()
    return per_token
