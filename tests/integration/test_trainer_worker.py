"""The real trainer worker (default model, real torch + PEFT) driven through TrainerProcess."""

from __future__ import annotations

import asyncio
import math
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
from artlike_server.default_model import ensure_default_model
from artlike_server.trainer_ipc import protocol
from artlike_server.trainer_ipc.batch_file import write_batch
from artlike_server.trainer_ipc.sequences import TrainSequence
from artlike_server.training.trainer_client import TrainerCrashed, TrainerError, TrainerProcess
from safetensors.torch import load_file

from artlike.types import GRPOConfig, LoraConfig, TrainConfig

pytestmark = pytest.mark.integration

MODEL_NAME = "worker-test.m"
LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])
QUESTIONS = ["What is 2+3?", "Name a colour.", "Say hello.", "What is the capital of Italy?"]
ANSWERS = ["2+3 is 5.", "Blue.", "Hello!", "Rome is the capital of Italy."]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("trainer")


@pytest.fixture(scope="module")
async def trainer(workdir: Path) -> AsyncIterator[TrainerProcess]:
    # float32 so that "outputs equal the base model" can be checked exactly.
    process = TrainerProcess(ensure_default_model(), dtype="float32", log_path=workdir / "trainer.log")
    await process.start()
    yield process
    await process.stop()


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_default_model())


def load_base() -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ensure_default_model(), dtype=torch.float32).eval()


def chat_batch(tokenizer: Any) -> list[TrainSequence]:
    sequences = []
    for index, (question, answer) in enumerate(zip(QUESTIONS, ANSWERS, strict=True)):
        prompt = list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": question}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
        output = [*tokenizer.encode(answer, add_special_tokens=False), tokenizer.eos_token_id]
        # Half the sequences carry (made-up) behaviour logprobs, half are "on-policy" (unknown).
        behaviour = [-1.0] * len(output) if index % 2 else [math.nan] * len(output)
        sequences.append(
            TrainSequence(
                token_ids=prompt + output,
                trainable=[False] * len(prompt) + [True] * len(output),
                behaviour_logprobs=[0.0] * len(prompt) + behaviour,
                advantage=1.0 if index < 2 else -1.0,
                trajectory_id=f"t{index}",
            )
        )
    return sequences


async def train_events(
    trainer: TrainerProcess, source: Path, out: Path, batch: Path, config: TrainConfig
) -> list[protocol.TrainEvent]:
    return [event async for event in trainer.train(MODEL_NAME, source, out, batch, config)]


@pytest.fixture(scope="module")
async def initial_adapter(trainer: TrainerProcess, workdir: Path) -> Path:
    ready = await trainer.init_adapter(MODEL_NAME, LORA, workdir / "step0", seed=1)
    assert ready.event == "adapter_ready"
    return workdir / "step0"


@pytest.fixture(scope="module")
def batch_path(workdir: Path, tokenizer: Any) -> Path:
    path = workdir / "batch.safetensors"
    write_batch(path, chat_batch(tokenizer))
    return path


async def test_a_fresh_adapter_loads_in_peft_and_changes_nothing(
    initial_adapter: Path, tokenizer: Any
) -> None:
    from peft import PeftConfig, PeftModel

    config = PeftConfig.from_pretrained(str(initial_adapter))
    assert (config.r, config.lora_alpha, set(config.target_modules)) == (
        4,
        8.0,
        {"q_proj", "v_proj", "down_proj"},
    )
    ids = torch.tensor([tokenizer.encode("The quick brown fox jumps over the lazy dog")])
    base = load_base()
    with torch.no_grad():
        expected = base(input_ids=ids).logits
        with_adapter = PeftModel.from_pretrained(base, str(initial_adapter)).eval()
        assert torch.equal(with_adapter(input_ids=ids).logits, expected)


async def test_two_optimizer_steps_stream_in_order_and_save_a_changed_adapter(
    trainer: TrainerProcess, initial_adapter: Path, batch_path: Path, workdir: Path, tokenizer: Any
) -> None:
    config = GRPOConfig(learning_rate=1e-3, gradient_steps_per_epoch=2, micro_batch_tokens=64)
    events = await train_events(trainer, initial_adapter, workdir / "step1", batch_path, config)

    names = [e.event for e in events]
    assert names[0] == "train_started" and names[-1] == "saved"
    started = events[0]
    assert isinstance(started, protocol.TrainStarted)
    assert started.optimizer_state == "fresh" and started.num_gradient_steps == 2
    assert "progress" in names
    steps = [e for e in events if isinstance(e, protocol.Step)]
    assert [s.gradient_step for s in steps] == [1, 2]
    assert names.index("saved") > names.index("step")
    for step in steps:
        assert math.isfinite(step.loss) and step.grad_norm > 0 and step.entropy > 0
        assert step.num_gradient_steps == 2
    trainable = sum(s.num_trainable_tokens for s in chat_batch(tokenizer))
    assert sum(s.tokens for s in steps) == trainable

    before = load_file(str(initial_adapter / "adapter_model.safetensors"))
    after = load_file(str(workdir / "step1" / "adapter_model.safetensors"))
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert (initial_adapter / "adapter_config.json").read_text() == (
        workdir / "step1" / "adapter_config.json"
    ).read_text()


async def test_optimizer_state_continues_only_from_the_step_it_produced(
    trainer: TrainerProcess, initial_adapter: Path, batch_path: Path, workdir: Path
) -> None:
    config = GRPOConfig(learning_rate=1e-3, kl_beta=0.1)
    continued = await train_events(trainer, workdir / "step1", workdir / "step2", batch_path, config)
    assert isinstance(continued[0], protocol.TrainStarted) and continued[0].optimizer_state == "reused"
    [step] = [e for e in continued if isinstance(e, protocol.Step)]
    assert step.kl > 0  # the adapter has moved away from the base model
    assert step.loss == pytest.approx(step.policy_loss + 0.1 * step.kl, rel=1e-5)

    rolled_back = await train_events(trainer, initial_adapter, workdir / "step1-again", batch_path, config)
    assert isinstance(rolled_back[0], protocol.TrainStarted) and rolled_back[0].optimizer_state == "fresh"


async def test_a_bad_batch_is_an_error_and_the_worker_stays_up(
    trainer: TrainerProcess, initial_adapter: Path, workdir: Path
) -> None:
    bad = workdir / "bad.safetensors"
    write_batch(bad, [TrainSequence([1, 2, 10**6], [False, True, True], [0.0, -1.0, -1.0], 1.0)])
    pid = trainer.pid
    with pytest.raises(TrainerError) as info:
        await train_events(trainer, initial_adapter, workdir / "never", bad, GRPOConfig())
    assert info.value.kind == "BatchError"
    assert not (workdir / "never").exists()

    with pytest.raises(TrainerError) as info:  # a step directory is never overwritten
        await trainer.init_adapter(MODEL_NAME, LORA, initial_adapter)
    assert info.value.kind == "AdapterError"

    await trainer.ping()
    assert trainer.pid == pid


async def test_a_killed_worker_is_reported_as_crashed_and_restarted(
    trainer: TrainerProcess, initial_adapter: Path, batch_path: Path, workdir: Path
) -> None:
    pid = trainer.pid
    assert pid is not None
    with pytest.raises(TrainerCrashed) as info:
        async for event in trainer.train(
            MODEL_NAME, initial_adapter, workdir / "killed", batch_path, GRPOConfig()
        ):
            if event.event == "train_started":
                os.kill(pid, signal.SIGKILL)
    assert info.value.returncode == -signal.SIGKILL
    assert not (workdir / "killed").exists()

    await asyncio.wait_for(trainer.ping(), timeout=300)  # starts a fresh worker
    assert trainer.pid not in (None, pid)


async def test_a_worker_given_cores_runs_on_them_only(workdir: Path) -> None:
    """`artlike serve --trainer-cpus`: the worker pins itself before torch starts its threads."""
    core = min(os.sched_getaffinity(0))
    process = TrainerProcess(ensure_default_model(), dtype="float32", cpus=(core,), log_path=workdir / "pinned.log")
    await process.start()
    try:
        assert process.ready_info is not None and process.ready_info.threads == 1
        status = await asyncio.to_thread(Path(f"/proc/{process.pid}/status").read_text)
        assert f"Cpus_allowed_list:\t{core}\n" in status, status
    finally:
        await process.stop()
