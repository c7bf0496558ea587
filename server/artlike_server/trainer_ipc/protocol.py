"""The line protocol between the server and its trainer worker process.

stdin: one JSON command per line. stdout: one JSON event per line (all logging goes to stderr); both sides
are the pydantic models below (`Command`, `WorkerEvent`). Every
command carries an integer `id`, echoed in each event it causes, so a client can skip the late events of a
command it stopped waiting for. Commands run one at a time, in order.

    {"cmd": "ping", "id": 1}
        -> {"event": "pong", "id": 1}
    {"cmd": "init_adapter", "id": 2, "model_name": "m", "lora": {LoraConfig}, "out_dir": "...", "seed": 0}
        -> {"event": "adapter_ready", "id": 2, "path": "...", "seconds": 0.4}
    {"cmd": "train", "id": 3, "model_name": "m", "adapter_dir": "...", "out_dir": "...",
     "batch_path": "...", "config": {TrainConfig}, "reference_adapter_dir": null | "..."}
        -> {"event": "train_started", "id": 3, "num_gradient_steps": 2, "sequences": 8, "trainable_tokens": 900,
            "optimizer_state": "reused" | "fresh"}
        -> {"event": "progress", "id": 3, "gradient_step": 1, "micro_batch": 0, "micro_batches": 2}   (0..n)
        -> {"event": "step", "id": 3, ...StepEvent fields}                                          (per step)
        -> {"event": "saved", "id": 3, "path": "...", "seconds": 0.1}
    {"cmd": "shutdown", "id": 4}
        -> {"event": "bye", "id": 4}, then the process exits 0
    {"cmd": "score", "id": 5, "adapter_dir": "...", "token_ids": [[...], ...]}
        -> {"event": "scores", "id": 5, "scores": [[s_0, ..., s_K-1], ...], "combined": [...], "seconds": 0.1}
        A score may be sent while a `train` runs (the one command that may overlap another): the worker
        answers it between two micro-batches, so scoring waits for at most one micro-batch.

    Training sessions (low-level primitives, `torch_worker/training_sessions.py`), each answered by one event:
    {"cmd": "session_open", "model_name", "adapter_dir", "optimizer": {AdamParams}}  -> session_ready
    {"cmd": "pass", "model_name", "batch_path", "config": {TrainConfig | TinkerLossConfig}, "backward": true,
     "reference_adapter_dir": null}                                                   -> pass_done (loss, logprobs)
    {"cmd": "passes", "passes": [{pass}, ...]}  (one per model)   -> passes_done (each pass's pass_done or error)
    {"cmd": "optim_step", "model_name", "optimizer": {AdamParams}}                    -> optimized (grad_norm)
    {"cmd": "save_state", "model_name", "out_dir"}                                    -> saved
    {"cmd": "session_close", "model_name"}                                            -> closed

    On start, before any command:  {"event": "ready", "id": 0, "device": "cpu", "dtype": "bfloat16",
                                    "threads": 2, "backend": "peft" | "unsloth", "load_seconds": 3.1}
    Any command that fails:         {"event": "error", "id": N, "kind": "BatchError", "message": "..."}
                                    and the worker waits for the next command. A crash ends the process:
                                    the client sees EOF on stdout.

`out_dir` must not exist or be an empty directory; the worker writes the adapter into a temporary sibling and renames it, so a crash
never leaves half an adapter. `batch_path` is a `batch_file` safetensors file written by the server.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter, model_validator

from artlike.session_types import AdamParams
from artlike.types import LoraConfig, RewardHeadConfig, StepEvent, TrainConfig

from .tinker_loss import TinkerLossConfig


class _Command(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: int = 0


class Ping(_Command):
    cmd: Literal["ping"] = "ping"


class Shutdown(_Command):
    cmd: Literal["shutdown"] = "shutdown"


class InitAdapter(_Command):
    cmd: Literal["init_adapter"] = "init_adapter"
    model_name: str
    lora: LoraConfig
    out_dir: str
    seed: int = 0
    reward_head: RewardHeadConfig | None = None  # a reward model's step 0: the adapter and a fresh score head


class Train(_Command):
    cmd: Literal["train"] = "train"
    model_name: str
    adapter_dir: str
    out_dir: str
    batch_path: str
    config: TrainConfig
    reference_adapter_dir: str | None = None  # the step named by the config's `reference` (DPO)
    reward_model_dir: str | None = None  # the reward model step that scores the sequences (PPO's `reward_model`)


class Score(_Command):
    """Score whole token sequences with the reward model step at `adapter_dir`."""

    cmd: Literal["score"] = "score"
    adapter_dir: str
    token_ids: list[list[int]]
    micro_batch_tokens: int = 8192


class SessionOpen(_Command):
    """Start a training session on `model_name` at `adapter_dir` (its `optimizer.pt` too, when there is one,
    unless `fresh_optimizer`)."""

    cmd: Literal["session_open"] = "session_open"
    model_name: str
    adapter_dir: str
    optimizer: AdamParams
    fresh_optimizer: bool = False


def _pass_config_kind(value: Any) -> str:
    objective = value.get("objective") if isinstance(value, dict) else getattr(value, "objective", None)
    return "tinker" if objective == "tinker" else "train"


PassConfig = Annotated[
    Annotated[TrainConfig, Tag("train")] | Annotated[TinkerLossConfig, Tag("tinker")],
    Discriminator(_pass_config_kind),
]
"""What a pass trains with: a job's objective, or one of Tinker's losses (a server-internal config)."""


class Pass(_Command):
    """A forward (and, with `backward`, backward) pass over the batch file; gradients accumulate."""

    cmd: Literal["pass"] = "pass"
    model_name: str
    batch_path: str
    config: PassConfig
    backward: bool = True
    reference_adapter_dir: str | None = None


class Passes(_Command):
    """Several sessions' passes (one per model) run together: where their objectives allow, as one pass whose
    rows each go through their own session's adapter (`torch_worker/fused_passes.py`); answered by one
    `passes_done` with each pass's own answer."""

    cmd: Literal["passes"] = "passes"
    passes: list[Pass] = Field(min_length=1)

    @model_validator(mode="after")
    def _one_per_model(self) -> Passes:
        models = [command.model_name for command in self.passes]
        if len(set(models)) != len(models):
            raise ValueError("each model may have one pass in a `passes` command")
        return self


class OptimStep(_Command):
    cmd: Literal["optim_step"] = "optim_step"
    model_name: str
    optimizer: AdamParams


class SaveState(_Command):
    """Write the session's adapter and optimizer state to `out_dir` (absent or empty)."""

    cmd: Literal["save_state"] = "save_state"
    model_name: str
    out_dir: str


class SessionClose(_Command):
    """End the session: drop its pending gradients."""

    cmd: Literal["session_close"] = "session_close"
    model_name: str


Command = Annotated[
    Ping | Shutdown | InitAdapter | Train | Score | SessionOpen | Pass | Passes | OptimStep | SaveState
    | SessionClose,
    Field(discriminator="cmd"),
]

# ------------------------------------------------------------------------------------------- events


class _Event(BaseModel):
    id: int = 0  # the command it answers (0: `ready`, before any command)


class Ready(_Event):
    event: Literal["ready"] = "ready"
    device: str
    dtype: str
    threads: int
    backend: Literal["peft", "unsloth"]
    gradient_checkpointing: bool = False
    vocab_size: int
    load_seconds: float
    ranks: int = 1  # processes training together under torchrun (torch_worker/distributed.py)
    attention: str = "sdpa"  # transformers' attention implementation (torch_worker/attention.py on a CPU)


class Pong(_Event):
    event: Literal["pong"] = "pong"


class AdapterReady(_Event):
    event: Literal["adapter_ready"] = "adapter_ready"
    path: str
    seconds: float


class TrainStarted(_Event):
    event: Literal["train_started"] = "train_started"
    num_gradient_steps: int
    sequences: int
    trainable_tokens: int
    optimizer_state: Literal["reused", "fresh"]


class Progress(_Event):
    event: Literal["progress"] = "progress"
    gradient_step: int
    micro_batch: int
    micro_batches: int


class Step(StepEvent):
    """One optimizer step: the `StepEvent` the job streams, plus the protocol's fields."""

    event: Literal["step"] = "step"
    id: int = 0

    def step_event(self) -> StepEvent:
        return StepEvent.model_validate(self.model_dump(exclude={"event", "id"}))


class Scores(_Event):
    event: Literal["scores"] = "scores"
    scores: list[list[float]]  # [N][K]: per sequence, per objective
    combined: list[float]  # [N]: Σ wₖ·sₖ
    seconds: float


class Saved(_Event):
    event: Literal["saved"] = "saved"
    path: str
    seconds: float


class SessionReady(_Event):
    event: Literal["session_ready"] = "session_ready"
    optimizer_state: Literal["reused", "loaded", "fresh"]  # kept in memory, read from optimizer.pt, or new


class PassDone(_Event):
    event: Literal["pass_done"] = "pass_done"
    loss: float
    tokens: int
    objective: str
    metrics: dict[str, float]
    logprobs: list[list[float | None]]  # per sequence of the batch file, aligned to its token ids
    seconds: float
    fused: int = 1  # how many sessions' passes ran as this one pass (`Passes`)


class Optimized(_Event):
    event: Literal["optimized"] = "optimized"
    grad_norm: float
    seconds: float


class Closed(_Event):
    event: Literal["closed"] = "closed"


class Failed(_Event):
    """A command failed; the worker waits for the next one."""

    event: Literal["error"] = "error"
    kind: str
    message: str


class PassesDone(_Event):
    """The answers of a `passes` command, in its order: each pass's `pass_done` or `error` (its own id)."""

    event: Literal["passes_done"] = "passes_done"
    results: list[Annotated[PassDone | Failed, Field(discriminator="event")]]


class Bye(_Event):
    event: Literal["bye"] = "bye"


class Heartbeat(_Event):
    """Made by the trainer client, never by the worker: the worker was quiet for a while during `train`."""

    event: Literal["heartbeat"] = "heartbeat"
    elapsed_seconds: float
    idle_seconds: float
    gradient_step: int | None = None  # from the last `progress`, if any
    micro_batch: int | None = None
    micro_batches: int | None = None


WorkerEvent = Annotated[
    Ready | Pong | AdapterReady | TrainStarted | Progress | Step | Saved | Failed | Bye | SessionReady | PassDone
    | PassesDone | Optimized | Closed | Scores,
    Field(discriminator="event"),
]
WORKER_EVENT: TypeAdapter[WorkerEvent] = TypeAdapter(WorkerEvent)

TrainEvent = TrainStarted | Progress | Step | Saved | Heartbeat
"""What `TrainerProcess.train` yields."""

TERMINAL_EVENTS = (Pong, AdapterReady, Saved, Failed, Bye, SessionReady, PassDone, PassesDone, Optimized, Closed,
                   Scores)
"""The last event of a command: after it the worker reads the next command."""
