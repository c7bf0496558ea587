"""Where each of N local engines runs: its own CPU cores, or its own GPUs.

On CPU, vLLM binds one OpenMP thread per listed core (VLLM_CPU_OMP_THREADS_BIND), so engines sharing a core
would thrash it: the cores are split into contiguous, near-equal groups. On CUDA each engine gets
`devices_per_engine(engine_args)` GPUs (tensor x pipeline x data parallel sizes from the pass-through vLLM
arguments) from the visible list, through CUDA_VISIBLE_DEVICES; vLLM's own executors use them from there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence

_PARALLEL_FLAGS = {
    "--tensor-parallel-size": "tp", "-tp": "tp",
    "--pipeline-parallel-size": "pp", "-pp": "pp",
    "--data-parallel-size": "dp", "-dp": "dp",
}


class PlacementError(ValueError):
    """The engines asked for do not fit on this machine's cores or GPUs."""


def split_cpus(cpus: Sequence[int] | None, engines: int) -> list[tuple[int, ...]]:
    """`cpus` (None: every core this process may use) in `engines` contiguous groups, sizes differing by at
    most one.

    >>> split_cpus([0, 1, 2, 3, 4], 2)
    [(0, 1, 2), (3, 4)]
    """
    ordered = sorted(set(os.sched_getaffinity(0) if cpus is None else cpus))
    if engines < 1:
        raise PlacementError(f"need at least one engine, not {engines}")
    if len(ordered) < engines:
        raise PlacementError(f"{engines} engines need at least {engines} cores; only {len(ordered)} are usable "
                             f"({ordered}): lower --engines or list more with --engine-cpus")
    size, extra = divmod(len(ordered), engines)
    groups, start = [], 0
    for index in range(engines):
        end = start + size + (1 if index < extra else 0)
        groups.append(tuple(ordered[start:end]))
        start = end
    return groups


def trainer_owns_its_cores(engine_cpus: Sequence[int] | None, trainer_cpus: Sequence[int] | None,
                           local_engines: int) -> bool:
    """Whether no local engine runs on the trainer's cores (None: every usable core), so that the trainer's
    OpenMP threads may spin briefly between parallel regions instead of sleeping (`TrainerProcess`).

    >>> trainer_owns_its_cores([0], [1], local_engines=1), trainer_owns_its_cores(None, [1], local_engines=1)
    (True, False)
    """
    if local_engines == 0:
        return True
    if engine_cpus is None or trainer_cpus is None:
        return False
    return not set(engine_cpus) & set(trainer_cpus)


def devices_per_engine(engine_args: Sequence[str]) -> int:
    """GPUs one engine uses: the product of the parallel sizes among vLLM's arguments (1 by default)."""
    sizes = {"tp": 1, "pp": 1, "dp": 1}
    args = list(engine_args)
    for index, arg in enumerate(args):
        flag, sep, value = arg.partition("=")
        if flag in _PARALLEL_FLAGS:
            if not sep:
                value = args[index + 1] if index + 1 < len(args) else ""
            try:
                sizes[_PARALLEL_FLAGS[flag]] = int(value)
            except ValueError as error:
                raise PlacementError(f"{flag} needs a number, not {value!r}") from error
    return sizes["tp"] * sizes["pp"] * sizes["dp"]


def visible_gpus(env: Mapping[str, str] | None = None) -> list[str]:
    """The GPUs this process may use: CUDA_VISIBLE_DEVICES if set, else those `nvidia-smi -L` lists."""
    env = os.environ if env is None else env
    if (listed := env.get("CUDA_VISIBLE_DEVICES")) is not None:
        return [gpu.strip() for gpu in listed.split(",") if gpu.strip()]
    if shutil.which("nvidia-smi") is None:
        return []
    result = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=False)
    return [str(index) for index, line in enumerate(result.stdout.splitlines()) if line.startswith("GPU ")]


def split_gpus(gpus: Sequence[str], engines: int, per_engine: int) -> list[tuple[str, ...]]:
    """Consecutive groups of `per_engine` GPUs, one per engine.

    >>> split_gpus(["0", "1", "2", "3"], 2, 2)
    [('0', '1'), ('2', '3')]
    """
    if len(gpus) < engines * per_engine:
        raise PlacementError(f"{engines} engines of {per_engine} GPU(s) each need {engines * per_engine} GPUs; "
                             f"{len(gpus)} are visible ({list(gpus)})")
    return [tuple(gpus[i * per_engine:(i + 1) * per_engine]) for i in range(engines)]
