"""Several trainer ranks under `torchrun`: data parallelism over the micro-batches of each optimizer step.

Every rank holds the whole base model and the same adapters (no FSDP: the base model must fit on each
device). Rank 0 alone speaks the protocol; it broadcasts each command line to the others, so every rank
runs the same commands in the same order (`broadcast_line`) and then checks that they all ended alike
(`agree`). Within a step each rank runs its share of the planned micro-batches (`shard_micro_batches`),
each loss divided by the whole step's normaliser, so the SUM of the ranks' gradients is the one-rank
step's gradient (`sum_gradients`, before clipping); the statistics are summed likewise (`gather`).

The gradients are all-reduced by hand rather than through DDP: only the adapter's and heads' gradients
(a few MB) need it, once per optimizer step, and DDP would require every forward to go through its
wrapper, the same number of forwards on every rank (the shards are uneven) and a fixed set of used
parameters (adapters and heads change from job to job).

Process groups: the default group (NCCL on CUDA, gloo on CPU) carries gradients; a gloo group carries
the command lines and outcomes, with a timeout long enough for an idle server (the other ranks wait there
for rank 0's next command, a cheap blocking wait); on CUDA another gloo group carries pickled objects.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

# A collective that waits longer than this means a rank is lost (the server's watchdog is shorter anyway).
COLLECTIVE_TIMEOUT = timedelta(minutes=30)
# The other ranks wait for rank 0's next command for as long as the server stays idle.
COMMAND_TIMEOUT = timedelta(days=3650)

Outcome = tuple[Literal["ok", "main_only", "failed"], str]
"""How a command ended on one rank: ok; failed in rank 0's own work after the last collective
("main_only", e.g. writing the adapter); or failed in the shared part; with the exception's type name."""


class RanksDiverged(RuntimeError):
    """The ranks ended a command differently, so they may no longer run the same collectives: fatal."""


@dataclass(frozen=True)
class Ranks:
    """This process's place among the trainer's ranks; `Ranks()` is the single-process trainer."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    objects: Any = None  # the group for pickled objects (None: the default group)
    commands: Any = None  # the gloo group for command lines and outcomes

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


SINGLE = Ranks()


def from_environment(environ: dict[str, str] | None = None) -> Ranks:
    """The ranks torchrun describes in the environment (not yet connected: `connect`)."""
    env = os.environ if environ is None else environ
    world_size = int(env.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return SINGLE
    return Ranks(rank=int(env["RANK"]), world_size=world_size, local_rank=int(env["LOCAL_RANK"]),
                 local_world_size=int(env.get("LOCAL_WORLD_SIZE", str(world_size))))


def connect(ranks: Ranks, device: torch.device) -> Ranks:
    """Join the process groups (torchrun's MASTER_ADDR/MASTER_PORT rendezvous); returns `ranks` with them."""
    if not ranks.distributed:
        return ranks
    if device.type == "cuda":
        dist.init_process_group("nccl", timeout=COLLECTIVE_TIMEOUT, device_id=device)
        objects = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    else:
        dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
        objects = None
    commands = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
    return Ranks(ranks.rank, ranks.world_size, ranks.local_rank, ranks.local_world_size, objects, commands)


def disconnect(ranks: Ranks) -> None:
    if ranks.distributed and dist.is_initialized():
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------- pure


def shard_micro_batches(costs: Sequence[int], world_size: int) -> list[list[int]]:
    """Each rank's micro-batches of one step (indices, in plan order), from their costs (decoder positions).

    Longest-first to the least loaded rank, ties to the lower rank: deterministic, so every rank computes
    the same split without talking. A rank may get none (fewer micro-batches than ranks).

    >>> shard_micro_batches([5, 3, 3, 2], 2)
    [[0, 3], [1, 2]]
    >>> shard_micro_batches([4], 2)
    [[0], []]
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, not {world_size}")
    loads = [0] * world_size
    shards: list[list[int]] = [[] for _ in range(world_size)]
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        shards[rank].append(index)
        loads[rank] += costs[index]
    return [sorted(shard) for shard in shards]


def rank_cpus(cpus: Sequence[int], local_rank: int, local_world_size: int) -> list[int]:
    """The cores of one CPU rank: a contiguous share of `cpus` (all of them when there are fewer cores
    than ranks: the ranks then share them).

    >>> rank_cpus([0, 1, 2, 3, 4], 1, 2)
    [3, 4]
    """
    if len(cpus) < local_world_size:
        return list(cpus)
    share, extra = divmod(len(cpus), local_world_size)
    start = local_rank * share + min(local_rank, extra)
    return list(cpus[start : start + share + (local_rank < extra)])


def in_step(outcomes: Sequence[Outcome]) -> bool:
    """Whether ranks that ended a command so are still in step: all succeeded (rank 0's own work after
    the last collective may have failed), or all failed alike in the shared part (a bad command fails on
    every rank at the same check)."""
    kinds = {status for status, _ in outcomes}
    if kinds <= {"ok", "main_only"}:
        return all(status == "ok" for status, _ in outcomes[1:])
    return kinds == {"failed"} and len({name for _, name in outcomes}) == 1


# ----------------------------------------------------------------------------------- collectives


def broadcast_line(ranks: Ranks, line: bytes | None) -> bytes | None:
    """Rank 0's next command line (None: its input ended) on every rank; the others pass anything."""
    if not ranks.distributed:
        return line
    box: list[Any] = [line if ranks.is_main else None]
    dist.broadcast_object_list(box, src=0, group=ranks.commands)
    value = box[0]
    assert value is None or isinstance(value, bytes), type(value)
    return value


def agree(ranks: Ranks, outcome: Outcome) -> None:
    """Compare how the command ended on every rank; raises `RanksDiverged` when they are out of step."""
    if not ranks.distributed:
        return
    outcomes: list[Any] = [None] * ranks.world_size
    dist.all_gather_object(outcomes, outcome, group=ranks.commands)
    if not in_step(outcomes):
        raise RanksDiverged(f"the trainer's ranks ended a command differently: {outcomes}")


def gather(ranks: Ranks, value: T) -> list[T]:
    """Every rank's `value` (picklable; tensors on the CPU), in rank order, on every rank."""
    if not ranks.distributed:
        return [value]
    values: list[Any] = [None] * ranks.world_size
    dist.all_gather_object(values, value, group=ranks.objects)
    return values


def barrier(ranks: Ranks) -> None:
    if ranks.distributed:
        dist.barrier(group=ranks.objects)


@torch.no_grad()
def sum_gradients(ranks: Ranks, parameters: Sequence[torch.Tensor]) -> None:
    """Replace each parameter's gradient by the sum over the ranks (the same on every rank afterwards).

    A gradient that is None on some ranks (a rank without micro-batches) counts as zeros; one that is None
    on every rank stays None, as on a single rank (the optimizer then skips that parameter).
    """
    if not ranks.distributed or not parameters:
        return
    present = torch.tensor([p.grad is not None for p in parameters], dtype=torch.int32,
                           device=parameters[0].device)  # fmt: skip
    dist.all_reduce(present, op=dist.ReduceOp.MAX)
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for parameter, flag in zip(parameters, present.tolist(), strict=True):
        if flag:
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
            buckets.setdefault((parameter.grad.dtype, parameter.grad.device), []).append(parameter)
    for members in buckets.values():  # one flat all-reduce per dtype: LoRA gradients are small
        grads = [p.grad for p in members if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()


@torch.no_grad()
def broadcast_parameters(ranks: Ranks, parameters: Sequence[torch.Tensor]) -> None:
    """Rank 0's values of `parameters` on every rank (a freshly initialised adapter must be one adapter)."""
    if not ranks.distributed:
        return
    for parameter in parameters:
        dist.broadcast(parameter.data, src=0)
