"""The Tinker service's scheduling over fake parts: one run's pass in the trainer never holds back sampling,
and a run's operations wait for each other in the SDK's order while other runs' do not."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import orjson
from artlike_server.state import BaseModelInfo
from artlike_server.tinker import paths
from artlike_server.tinker.requests import SampleBody
from artlike_server.tinker.runs import Run
from artlike_server.tinker.service import TinkerService
from artlike_server.tinker.wire_schema import DTYPE_FLOAT32, DTYPE_INT64, ForwardBackwardRequest

from artlike.session_types import PassResult, SequenceResult


class SlowTrainer:
    """`run_sequences` holds each pass until the test releases it, as a long pass in the trainer would."""

    def __init__(self) -> None:
        self.training = SimpleNamespace(limits=SimpleNamespace(max_sequence_tokens=1000))
        self.release = asyncio.Event()
        self.started: list[str] = []

    async def run_sequences(self, session_id: str, sequences: list[Any], config: Any, *, backward: bool) -> PassResult:
        self.started.append(session_id)
        await self.release.wait()
        return PassResult(loss=1.0, tokens=2, objective="tinker", metrics={}, pending_passes=1, seconds=0.0,
                          sequences=[SequenceResult(logprobs=[None] + [-0.5] * (len(s.token_ids) - 1))
                                     for s in sequences])


class Engine:
    async def create_completion(self, endpoint: str, raw: bytes, trajectory_id: str | None = None) -> bytes:
        body = orjson.loads(raw)
        assert endpoint == "completions" and body["prompt"] == [1, 2] and trajectory_id
        return orjson.dumps({"choices": [{"index": 0, "token_ids": [7, 2], "finish_reason": "stop",
                                          "logprobs": {"token_logprobs": [-0.1, -0.2]}}]})


def service(tmp_path: Path, trainer: SlowTrainer) -> TinkerService:
    tinker = TinkerService(base=BaseModelInfo("base", tmp_path / "base", 64), data_dir=tmp_path,
                           store=cast(Any, None), models=cast(Any, None), registry=cast(Any, None),
                           sessions=cast(Any, trainer), serving=cast(Any, Engine()))
    for seq in (0, 1):
        run = Run(run_id=paths.run_id("tk0123456789abcdef", seq), base_model="base", lora_rank=8,
                  created_at=time.time(), last_request_time=time.time())
        tinker.runs.add(run)
        tinker._training[run.run_id] = f"session-{seq}"
    return tinker


def forward_backward(run: str, seq_id: int) -> bytes:
    request = ForwardBackwardRequest(model_id=run, seq_id=seq_id, loss_fn="cross_entropy")
    datum = request.data.add()
    datum.model_input.add().encoded_text.tokens = np.asarray([1, 2], dtype="<i4").tobytes()
    for key, values in (("target_tokens", np.asarray([2, 3], dtype="<i8")), ("weights", np.asarray([0, 1], dtype="<f4"))):
        tensor = datum.loss_fn_inputs[key]
        tensor.dtype = DTYPE_INT64 if values.dtype.kind == "i" else DTYPE_FLOAT32
        tensor.dense = values.tobytes()
    return cast(bytes, request.SerializeToString())


async def test_sampling_answers_while_a_pass_holds_the_trainer(tmp_path: Path) -> None:
    trainer = SlowTrainer()
    tinker = service(tmp_path, trainer)
    run = paths.run_id("tk0123456789abcdef", 0)
    training = tinker.forward_backward(forward_backward(run, 1))["request_id"]
    await asyncio.sleep(0.01)
    assert trainer.started == ["session-0"]
    sample = tinker.asample(SampleBody.model_validate({"base_model": "base", "num_samples": 1,
                                                       "prompt": {"chunks": [{"tokens": [1, 2]}]}}))
    outcome = await tinker.futures.wait(sample["request_id"], 5)
    assert outcome is not None and isinstance(outcome.payload, bytes)  # the sample is done ...
    assert await tinker.futures.wait(training, 0.01) is None  # ... while the pass still runs
    trainer.release.set()
    assert (await tinker.futures.wait(training, 5)) is not None
    await tinker.stop()


async def test_a_runs_next_operation_waits_for_its_pass_and_another_run_does_not(tmp_path: Path) -> None:
    trainer = SlowTrainer()
    tinker = service(tmp_path, trainer)
    first, second = paths.run_id("tk0123456789abcdef", 0), paths.run_id("tk0123456789abcdef", 1)
    tinker.forward_backward(forward_backward(first, 1))
    tinker.forward_backward(forward_backward(first, 2))
    tinker.forward_backward(forward_backward(second, 1))
    await asyncio.sleep(0.05)
    assert trainer.started == ["session-0", "session-1"]  # run 0's second pass waits for its first
    trainer.release.set()
    await asyncio.sleep(0.05)
    assert trainer.started == ["session-0", "session-1", "session-0"]
    await tinker.stop()
