"""Tinker datums as the trainer's sequences, the loss config, and the API's names and paths."""

from __future__ import annotations

import math

import numpy as np
import pytest
from artlike_server.errors import InvalidRequest, NotFound
from artlike_server.tinker import paths
from artlike_server.tinker.datums import datum_sequences, loss_config
from artlike_server.tinker.wire import WireDatum


def datum(tokens: list[int], **inputs: list[float] | list[int]) -> WireDatum:
    return WireDatum(tokens=tokens, loss_fn_inputs={k: np.asarray(v) for k, v in inputs.items()})


def test_a_cross_entropy_datum_is_its_sequence_with_every_target_scored_and_weighted() -> None:
    [sequence] = datum_sequences([datum([5, 6, 7], target_tokens=[6, 7, 8], weights=[0.0, 0.5, 1.0])],
                                 "cross_entropy", vocab_size=None, max_tokens=100)
    assert sequence.token_ids == [5, 6, 7, 8]
    assert sequence.trainable == [False, True, True, True]
    assert sequence.token_advantages == [0.0, 0.0, 0.5, 1.0]
    assert all(math.isnan(v) for v in sequence.behaviour_logprobs[1:])  # no sampler: ratio 1


def test_a_policy_gradient_datum_keeps_the_sampled_logprobs_of_the_targets_it_trains() -> None:
    [sequence] = datum_sequences([datum([5, 6, 7], target_tokens=[6, 7, 8], logprobs=[0.0, -0.5, -1.5],
                                        advantages=[0.0, 2.0, -1.0])], "ppo", vocab_size=None, max_tokens=100)
    assert sequence.token_advantages == [0.0, 0.0, 2.0, -1.0]
    assert math.isnan(sequence.behaviour_logprobs[1])  # a prompt token (advantage 0): not sampled
    assert sequence.behaviour_logprobs[2:] == [-0.5, -1.5]


@pytest.mark.parametrize(("data", "match"), [
    ([], "at least one datum"),
    ([datum([5, 6], target_tokens=[6, 7])], "lacks \\['weights'\\]"),
    ([datum([5, 6], target_tokens=[9, 7], weights=[1, 1])], "shifted by one"),
    ([datum([5, 6], target_tokens=[6, 7], weights=[1, 1, 1])], "expected \\[2\\]"),
    ([datum([5, 6], target_tokens=[6, 7], weights=[1, float("nan")])], "NaN"),
    ([datum(list(range(10)), target_tokens=[*range(1, 10), 10], weights=[1] * 10)], "over this server's limit"),
])
def test_datums_the_trainer_cannot_take_are_refused_naming_the_datum(data: list[WireDatum], match: str) -> None:
    with pytest.raises(InvalidRequest, match=match):
        datum_sequences(data, "cross_entropy", vocab_size=None, max_tokens=8)


def test_the_loss_config_takes_each_losss_own_keys() -> None:
    assert loss_config("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}).clip_high_threshold == 1.1
    assert loss_config("dro", {"beta": 0.05}).beta == 0.05
    with pytest.raises(InvalidRequest, match="not served here"):
        loss_config("stable_reinforce", {})
    with pytest.raises(InvalidRequest, match="do not apply"):
        loss_config("cross_entropy", {"beta": 0.1})
    with pytest.raises(InvalidRequest, match="beta"):
        loss_config("dro", {})


def test_run_ids_model_names_and_checkpoint_paths_map_both_ways() -> None:
    session = paths.new_session_id()
    run = paths.run_id(session, 3)
    assert paths.run_of_model(paths.model_name(run)) == run and paths.session_of_run(run) == session
    path = paths.parse_checkpoint_path(f"tinker://{run}/sampler_weights/000020")
    assert (path.run, path.kind, path.name, str(path)) == (run, "sampler_weights", "000020",
                                                          f"tinker://{run}/sampler_weights/000020")
    assert paths.run_of_model("my-model") is None
    with pytest.raises(NotFound):
        paths.model_name("someone-else:train:0")
    for bad in ("tinker://a/b", f"tinker://{run}/other/x", f"file://{run}/weights/x", f"tinker://{run}/weights/"):
        with pytest.raises(InvalidRequest):
            paths.parse_checkpoint_path(bad)
