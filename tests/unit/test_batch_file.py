"""The server→trainer batch file round-trips sequences exactly (NaN included)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from artlike_server.trainer_ipc.batch_file import BatchFileError, read_batch, write_batch
from artlike_server.trainer_ipc.sequences import TrainSequence


def test_round_trip(tmp_path: Path) -> None:
    sequences = [
        TrainSequence([1, 5, 7, 2], [False, False, True, True], [0.0, 0.0, -0.25, -1.5], 0.9, "t-a", 0),
        TrainSequence([1, 9, 2], [False, True, True], [0.0, math.nan, math.nan], -0.9, "t.b", 3),
    ]
    path = tmp_path / "batch.safetensors"
    write_batch(path, sequences)
    back = read_batch(path)
    assert [s.token_ids for s in back] == [s.token_ids for s in sequences]
    assert [s.trainable for s in back] == [s.trainable for s in sequences]
    assert back[0].behaviour_logprobs == [0.0, 0.0, -0.25, -1.5]  # exact in float32
    assert back[1].behaviour_logprobs[0] == 0.0 and all(math.isnan(x) for x in back[1].behaviour_logprobs[1:])
    assert [s.advantage for s in back] == [0.9, -0.9]
    assert [s.trajectory_id for s in back] == ["t-a", "t.b"]
    assert [s.group_index for s in back] == [0, 3]
    assert not list(tmp_path.glob(".*")), "no temporary file left behind"


def test_a_file_of_another_kind_is_rejected(tmp_path: Path) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    path = tmp_path / "other.safetensors"
    save_file({"x": np.zeros(3)}, str(path))
    with pytest.raises(BatchFileError):
        read_batch(path)


def test_misaligned_sequences_are_refused(tmp_path: Path) -> None:
    with pytest.raises(BatchFileError):
        write_batch(tmp_path / "b", [TrainSequence([1, 2], [False], [0.0, 0.0], 1.0)])


def test_token_advantages_round_trip_and_stay_absent_when_none_has_them(tmp_path: Path) -> None:
    with_them = TrainSequence([1, 5, 7], [False, True, True], [0.0, -0.5, -1.0], 0.0, token_advantages=[0.0, 1.5, -0.25])
    without = TrainSequence([1, 9], [False, True], [0.0, -2.0], 0.5)
    path = tmp_path / "batch.safetensors"
    write_batch(path, [with_them, without])
    back = read_batch(path)
    assert back[0].token_advantages == [0.0, 1.5, -0.25]  # exact in float32
    assert back[1].token_advantages is None

    write_batch(path, [without])
    assert read_batch(path)[0].token_advantages is None
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as handle:
        assert "token_advantages" not in handle.keys()  # noqa: SIM118 (safe_open is no mapping)

    with pytest.raises(BatchFileError):
        write_batch(path, [TrainSequence([1, 2], [False, True], [0.0, 0.0], 0.0, token_advantages=[1.0])])
