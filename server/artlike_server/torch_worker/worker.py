"""The trainer worker: a long-lived process that keeps the base model loaded and trains LoRA adapters.

    python -m artlike_server.torch_worker.worker --base-model DIR [--dtype auto|bfloat16|float32]
                                             [--device auto|cpu|cuda] [--gradient-checkpointing]
    python -m torch.distributed.run --standalone --nproc-per-node N -m artlike_server.torch_worker.worker ...

It speaks the line protocol of `artlike_server.trainer_ipc.protocol` on stdin/stdout. The base model is loaded
once (transformers, SDPA attention; unsloth's loader on CUDA when it is installed); every trainable model
name gets its own LoRA adapter and AdamW state in the one PEFT model. A failing command answers an `error`
event and the worker carries on; only a crash ends it.

Precision: base weights in bf16 where it runs fast (CUDA, or a CPU where `dtype_probe` measured so),
LoRA weights in the base dtype with fp32 master copies that AdamW (fp32 state) updates (see `precision`),
logprobs in fp32 (see `logprobs`).

Under torchrun (WORLD_SIZE > 1) every rank loads the model and runs every command but `score`; rank 0
alone reads stdin, writes events and files (`distributed.py`; docs/multi-gpu-training.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, cast

import orjson
import torch
from pydantic import TypeAdapter
from transformers import AutoModelForCausalLM, PreTrainedModel

from artlike.types import RewardModelConfig
from artlike_server import dtype_probe
from artlike_server.dtype_choice import decide_dtype
from artlike_server.hardware import DTYPE_CHOICES
from artlike_server.orphan_guard import set_parent_death_signal
from artlike_server.torch_worker import attention, distributed, memory
from artlike_server.torch_worker.adapters import AdapterSlots, check_writable, peft_lora_config
from artlike_server.torch_worker.distributed import SINGLE, Ranks
from artlike_server.torch_worker.heads import RewardHead
from artlike_server.torch_worker.loop import (
    BatchError,
    plan_job,
    run_optimizer_steps,
    score_sequences,
    validate_batch,
)
from artlike_server.torch_worker.objectives import build_objective
from artlike_server.torch_worker.training_sessions import SessionError, Sessions
from artlike_server.trainer_ipc import protocol
from artlike_server.trainer_ipc.batch_file import read_batch
from artlike_server.trainer_ipc.sequences import TrainSequence

logger = logging.getLogger("artlike.trainer")

_COMMAND = TypeAdapter(protocol.Command)


class EventWriter:
    """Writes one JSON event per line to the protocol stream, flushed at once (the server relays it live).
    Without a stream (a rank other than 0) the events go nowhere: rank 0 reports for all."""

    def __init__(self, stream: BinaryIO | None) -> None:
        self._stream = stream

    def emit(self, event: protocol.WorkerEvent) -> None:
        if self._stream is None:
            return
        self._stream.write(event.model_dump_json().encode() + b"\n")
        self._stream.flush()


# ------------------------------------------------------------------------------------------ set-up


def choose_device(requested: str, ranks: Ranks = SINGLE) -> torch.device:
    """The device asked for; one rank of several on CUDA takes GPU LOCAL_RANK of those it sees."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and ranks.distributed:
        return torch.device("cuda", ranks.local_rank)
    return torch.device(requested)


def choose_dtype(requested: str, device: torch.device, threads: int | None = None) -> torch.dtype:
    """`dtype_choice.decide_dtype` for the trainer role, plus the GPU's own bf16 check (older GPUs have none).
    The server always passes an explicit dtype; "auto" on a CPU (the worker run by hand) runs the cached
    dtype probe in a subprocess, as the server does."""
    if requested == "auto" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float32
    probe = dtype_probe.probe(threads=threads) if requested == "auto" and device.type != "cuda" else None
    choice = decide_dtype(requested, device.type, role="trainer", probe=probe)
    logger.info("trainer dtype %s", choice.describe())
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[choice.dtype]


def vocab_size(model: Any) -> int:
    """Rows of the input embedding (the ids a batch may hold; may exceed config.vocab_size after a resize)."""
    return int(model.get_input_embeddings().weight.shape[0])


def unsloth_available(device: torch.device) -> bool:
    """unsloth is CUDA-only: on a CPU machine it refuses to import (and pip would swap torch for a CUDA build)."""
    return device.type == "cuda" and importlib.util.find_spec("unsloth") is not None


def load_with_transformers(path: Path, dtype: torch.dtype, device: torch.device,
                           attention_implementation: str = "auto") -> PreTrainedModel:
    """The base model; attention "auto": on a CPU, small attention matrices as grouped matmuls
    (`attention.py`), else (and on CUDA) SDPA's kernels."""
    implementation = attention_implementation
    if implementation == "auto":
        implementation = attention.register() if device.type == "cpu" else "sdpa"
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype,
                                                                  attn_implementation=implementation)
    model.to(device)  # type: ignore[arg-type]  # in place; transformers' wrapper hides Module.to's signature
    return model


def load_with_unsloth(path: Path, dtype: torch.dtype) -> PreTrainedModel:
    """unsloth's patched model (fused RoPE/RMSNorm/cross-entropy kernels); adapters still go through PEFT.

    Untested in this repository's CI (no GPU): kept apart so the CPU path never imports it.
    """
    from unsloth import FastLanguageModel  # optional CUDA extra

    model, _tokenizer = FastLanguageModel.from_pretrained(
        model_name=str(path), dtype=dtype, load_in_4bit=False
    )
    return cast(PreTrainedModel, model)


# ---------------------------------------------------------------------------------------- commands


class CommandLines:
    """The protocol's command lines, read from stdin by a thread, so that a `score` can be answered while a
    `train` runs (`take_scores`); other lines read meanwhile wait their turn, in order."""

    def __init__(self, stream: BinaryIO) -> None:
        self._lines: queue.Queue[bytes | None] = queue.Queue()
        self._deferred: deque[bytes] = deque()
        threading.Thread(target=self._read, args=(stream,), name="commands", daemon=True).start()

    def _read(self, stream: BinaryIO) -> None:
        for line in stream:
            if line.strip():
                self._lines.put(line)
        self._lines.put(None)  # EOF

    def __iter__(self) -> Iterator[bytes]:
        while True:
            line = self._deferred.popleft() if self._deferred else self._lines.get()
            if line is None:
                return
            yield line

    def take_scores(self) -> list[bytes]:
        """The `score` lines waiting now (without blocking); any other line stays queued."""
        scores: list[bytes] = []
        while True:
            try:
                line = self._lines.get_nowait()
            except queue.Empty:
                return scores
            if line is not None and _is_score(line):
                scores.append(line)
            else:
                self._deferred.append(line)  # type: ignore[arg-type]  # None (EOF) is kept in order too


def _is_score(line: bytes) -> bool:
    try:
        value = orjson.loads(line)
    except orjson.JSONDecodeError:
        return False
    return isinstance(value, dict) and value.get("cmd") == "score"


class Worker:
    def __init__(self, base_model_path: Path, model: PreTrainedModel, events: EventWriter,
                 lines: CommandLines | None = None, ranks: Ranks = SINGLE) -> None:
        self._events = events
        self._lines = lines
        self._ranks = ranks
        self.main_only_failed = False  # the last command failed in rank 0's own part (`_main_only`)
        self._base_model_path = str(base_model_path)
        self._adapters = AdapterSlots(model, self._base_model_path)
        self._vocab_size = vocab_size(model)
        self._pad_token_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        self._device = next(model.parameters()).device
        self._sessions = Sessions(self._adapters, pad_token_id=self._pad_token_id, vocab_size=self._vocab_size,
                                  device=self._device, ranks=ranks)

    def handle(self, command: protocol.Command) -> None:
        if isinstance(command, protocol.SessionOpen):
            self._events.emit(self._sessions.open(command))
        elif isinstance(command, protocol.Pass):
            self._events.emit(self._sessions.run_pass(command))
        elif isinstance(command, protocol.Passes):
            self._events.emit(self._sessions.run_passes(command))
        elif isinstance(command, protocol.OptimStep):
            self._events.emit(self._sessions.optim_step(command))
        elif isinstance(command, protocol.SaveState):
            self._main_only(lambda: self._events.emit(self._sessions.save(command)))
        elif isinstance(command, protocol.SessionClose):
            self._events.emit(self._sessions.close(command))
        elif isinstance(command, protocol.Ping):
            self._events.emit(protocol.Pong(id=command.id))
        elif isinstance(command, protocol.InitAdapter):
            self._init_adapter(command)
        elif isinstance(command, protocol.Train):
            self._train(command)
        elif isinstance(command, protocol.Score):
            self._events.emit(self._score(command))
        elif isinstance(command, protocol.Shutdown):
            self._events.emit(protocol.Bye(id=command.id))

    def _main_only(self, work: Callable[[], None]) -> None:
        """Rank 0's own part of a command (files and their events), after the command's last collective: the
        other ranks skip it, and its failure leaves the ranks in step (`distributed.in_step`)."""
        if not self._ranks.is_main:
            return
        try:
            work()
        except Exception:
            self.main_only_failed = True
            raise

    def _init_adapter(self, command: protocol.InitAdapter) -> None:
        started = time.perf_counter()
        out_dir = Path(command.out_dir)
        check_writable(out_dir)
        config = peft_lora_config(command.lora, self._base_model_path)
        slot = self._adapters.create(command.model_name, config, seed=command.seed, reward_head=command.reward_head)
        # The same seed draws the same weights on every rank's CPU; a GPU's generator need not, so rank 0's win.
        distributed.broadcast_parameters(self._ranks, [*self._adapters.parameters(command.model_name),
                                                       *(p for head in slot.heads.values() for p in head.parameters())])

        def save() -> None:
            self._adapters.save(command.model_name, out_dir)
            self._events.emit(protocol.AdapterReady(id=command.id, path=str(out_dir),
                                                    seconds=time.perf_counter() - started))

        self._main_only(save)

    def _score(self, command: protocol.Score) -> protocol.Scores:
        started = time.perf_counter()
        for index, ids in enumerate(command.token_ids):
            if not ids or not 0 <= min(ids) <= max(ids) < self._vocab_size:
                raise BatchError(f"input {index} is empty or has token ids outside the vocabulary")
        with self._adapters.scorer(Path(command.adapter_dir)) as head:
            scores = score_sequences(self._adapters.model, command.token_ids, head, pad_token_id=self._pad_token_id,
                                     token_budget=command.micro_batch_tokens, device=self._device)  # fmt: skip
            combined = head.combined(scores)
        return protocol.Scores(id=command.id, scores=scores.tolist(), combined=combined.tolist(),
                               seconds=time.perf_counter() - started)

    def serve_waiting_scores(self) -> None:
        """Answer the `score` commands that arrived during a job (called between its micro-batches)."""
        if self._lines is None:
            return
        for line in self._lines.take_scores():
            command_id = _command_id(line)
            try:
                command = _COMMAND.validate_json(line)
                assert isinstance(command, protocol.Score)
                self._events.emit(self._score(command))
            except Exception as exc:  # reported to its caller; the job goes on
                logger.exception("score %s failed", command_id)
                self._events.emit(protocol.Failed(id=command_id, kind=type(exc).__name__, message=str(exc) or repr(exc)))

    def _reward_scores(self, reward_model_dir: str | None,
                       sequences: list[TrainSequence]) -> Callable[[], list[float]] | None:
        """The reward model's combined score of each sequence, when the job names one (PPO)."""
        if reward_model_dir is None:
            return None

        def scores() -> list[float]:
            with self._adapters.scorer(Path(reward_model_dir)) as head:
                values = score_sequences(self._adapters.model, [s.token_ids for s in sequences], head,
                                         pad_token_id=self._pad_token_id, token_budget=8192, device=self._device)
                return [float(v) for v in head.combined(values)]

        return scores

    def _train(self, command: protocol.Train) -> None:
        if self._sessions.is_open(command.model_name):  # the server never sends this; the worker checks anyway
            raise SessionError(f"{command.model_name!r} has an open training session; end it before a job")
        out_dir = Path(command.out_dir)
        check_writable(out_dir)  # fail before training, not after
        sequences = read_batch(Path(command.batch_path))
        validate_batch(sequences, self._vocab_size)
        slot = self._adapters.load(command.model_name, Path(command.adapter_dir))
        reward_head = slot.heads.get("reward")
        if isinstance(command.config, RewardModelConfig) != isinstance(reward_head, RewardHead):
            raise BatchError(f"{command.model_name!r} is {'a' if reward_head is not None else 'not a'} reward model; "
                             f"objective {command.config.objective!r} does not train it")
        objective = build_objective(command.config,
                                    reward_head=reward_head.config if isinstance(reward_head, RewardHead) else None)
        if "value" in objective.heads:
            self._adapters.value_head(command.model_name)
        reused = slot.optimizer is not None
        parameters = self._adapters.parameters(command.model_name)
        optimizer = slot.optimizer if slot.optimizer is not None else slot.start_optimizer(
            parameters, learning_rate=command.config.learning_rate, weight_decay=command.config.weight_decay
        )
        model = self._adapters.model
        config = command.config
        trainable = [sum(s.trainable[1:]) for s in sequences]
        plan = plan_job(sequences, config)
        reference = self._adapters.reference_policy(
            command.model_name, None if command.reference_adapter_dir is None else Path(command.reference_adapter_dir))
        self._events.emit(protocol.TrainStarted(
            id=command.id,
            num_gradient_steps=len(plan),
            sequences=len(sequences),
            trainable_tokens=sum(trainable),
            optimizer_state="reused" if reused else "fresh",
        ))
        def on_micro_batch(step: int, index: int, count: int) -> None:
            self._events.emit(protocol.Progress(id=command.id, gradient_step=step, micro_batch=index,
                                                micro_batches=count))
            self.serve_waiting_scores()

        model.train()
        try:
            result = run_optimizer_steps(
                model,
                optimizer,
                sequences,
                config,
                pad_token_id=self._pad_token_id,
                device=self._device,
                reference=reference,
                master=slot.master,
                on_step=lambda event: self._events.emit(protocol.Step(id=command.id, **event.model_dump())),
                on_micro_batch=on_micro_batch,
                heads=slot.heads,
                objective=objective,
                state=slot.state,
                reward_scores=self._reward_scores(command.reward_model_dir, sequences),
                ranks=self._ranks,
            )
        finally:
            model.eval()

        def save() -> None:
            started = time.perf_counter()
            self._adapters.save(command.model_name, out_dir, state=result.state)
            self._events.emit(protocol.Saved(id=command.id, path=str(out_dir), seconds=time.perf_counter() - started))

        self._main_only(save)


# -------------------------------------------------------------------------------------------- main


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m artlike_server.torch_worker.worker", description=__doc__)
    parser.add_argument("--base-model", type=Path, required=True, help="Hugging Face model directory")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--attention", choices=("auto", "sdpa", "eager"), default="auto",
                        help="transformers attention implementation (auto: attention.py's on a CPU, else sdpa)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: usable cores)")
    parser.add_argument("--cpus", default=None, help="run on these cores only, e.g. 1 or 2-3 (default: all usable)")
    return parser.parse_args(argv)


def _protocol_stream() -> BinaryIO:
    """Take over the real stdout for events and point fd 1 at stderr: a stray print() from any library then
    lands in the log instead of corrupting the protocol."""
    events_fd = os.dup(sys.stdout.fileno())
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    return os.fdopen(events_fd, "wb", buffering=0)


def _rank_streams(ranks: Ranks) -> tuple[EventWriter, CommandLines | None]:
    """The protocol's streams: rank 0 owns stdin and stdout (torchrun's workers inherit both); the others
    read nothing and write their stray output to stderr."""
    if ranks.is_main:
        return EventWriter(_protocol_stream()), CommandLines(sys.stdin.buffer)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    with open(os.devnull, "rb") as devnull:
        os.dup2(devnull.fileno(), sys.stdin.fileno())
    return EventWriter(None), None


def _watch_launcher(ranks: Ranks) -> None:
    """A rank dies with torchrun: the server kills torchrun (a timeout, an abandoned job), whose workers run
    in sessions of their own and would live on, holding a GPU."""
    if not ranks.distributed or sys.platform != "linux":
        return
    launcher = os.getppid()
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != launcher:  # it died before the signal was armed
        sys.exit(1)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    ranks = distributed.from_environment()
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO,
        format=f"%(asctime)s trainer{f' rank {ranks.rank}' if ranks.distributed else ''} %(levelname)s %(message)s",
    )  # fmt: skip
    _watch_launcher(ranks)
    events, lines = _rank_streams(ranks)
    started = time.perf_counter()
    cpus = [int(cpu) for cpu in args.cpus.split(",")] if args.cpus else None
    if ranks.distributed:  # each rank on its own share of the cores
        cpus = distributed.rank_cpus(sorted(cpus or os.sched_getaffinity(0)), ranks.local_rank, ranks.local_world_size)
    if cpus:  # before torch starts its thread pool, so its threads inherit the affinity
        os.sched_setaffinity(0, cpus)
    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    device = choose_device(args.device, ranks)
    if device.type == "cuda" and ranks.distributed:
        torch.cuda.set_device(device)
    ranks = distributed.connect(ranks, device)
    dtype = choose_dtype(args.dtype, device, threads)
    # unsloth's loader under torchrun is untried: several ranks use the plain transformers model.
    backend = "unsloth" if unsloth_available(device) and not ranks.distributed else "peft"
    model = (
        load_with_unsloth(args.base_model, dtype)
        if backend == "unsloth"
        else load_with_transformers(args.base_model, dtype, device, args.attention)
    )
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.eval()  # type: ignore[no-untyped-call]
    worker = Worker(args.base_model, model, events, lines, ranks)
    distributed.barrier(ranks)  # ready when every rank is
    events.emit(protocol.Ready(
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        threads=threads,
        backend=backend,
        gradient_checkpointing=bool(args.gradient_checkpointing),
        vocab_size=vocab_size(model),
        load_seconds=time.perf_counter() - started,
        ranks=ranks.world_size,
        attention=str(getattr(model.config, "_attn_implementation", None) or "sdpa"),
    ))
    logger.info("ready: %s %s on %s, %d threads, rank %d of %d", backend, dtype, device, threads, ranks.rank,
                ranks.world_size)
    try:
        serve(worker, events, lines, ranks)
    finally:
        distributed.disconnect(ranks)
    return 0


def serve(worker: Worker, events: EventWriter, lines: CommandLines | None, ranks: Ranks = SINGLE) -> None:
    """The command loop, until shutdown or the end of input. Rank 0 hands every command but `score` to all
    ranks (a score is answered by rank 0 alone: it has no collective), then they compare how it ended."""
    pending = iter(lines) if lines is not None else iter(())
    while True:
        line = next(pending, None) if ranks.is_main else None
        if line is not None and ranks.distributed and _is_score(line):
            run_command(worker, events, line)
            continue
        line = distributed.broadcast_line(ranks, line)
        if line is None:
            return
        outcome, command = run_command(worker, events, line)
        distributed.agree(ranks, outcome)
        if isinstance(command, protocol.Shutdown):
            return


def run_command(worker: Worker, events: EventWriter,
                line: bytes) -> tuple[distributed.Outcome, protocol.Command | None]:
    """Handle one command line; a failure is reported (the worker stays up for the next command)."""
    command_id = _command_id(line)
    worker.main_only_failed = False
    try:
        command = _COMMAND.validate_json(line)
        worker.handle(command)
    except Exception as exc:  # reported to the client
        logger.exception("command %s failed", command_id)
        events.emit(protocol.Failed(id=command_id, kind=type(exc).__name__, message=str(exc) or repr(exc)))
        return ("main_only" if worker.main_only_failed else "failed", type(exc).__name__), None
    finally:
        memory.release_freed_memory()  # the step's peak is not kept from the engines beside it
    return ("ok", ""), command


def _command_id(line: bytes) -> int:
    """The id of a command line, even when the rest of it is invalid (so its error event can name it)."""
    try:
        value = orjson.loads(line)
    except orjson.JSONDecodeError:
        return 0
    command_id = value.get("id") if isinstance(value, dict) else None
    return command_id if isinstance(command_id, int) else 0


if __name__ == "__main__":
    sys.exit(main())
