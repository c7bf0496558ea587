"""Run the rollouts of many trajectory groups concurrently, with a live progress bar and a failure policy.

Policy, in order:
- A rollout fails when its awaitable raises an `Exception` or returns a trajectory whose block raised
  (`t.failed`). Failures are counted over all groups; past `max_exceptions` the failure that crossed the
  limit is raised (with a note saying how many failed) and the remaining rollouts are cancelled.
- Within the limit, failed trajectories are dropped (kept on `group.exceptions` for inspection).
- A group left with fewer than `min_group_size` (default 2) trajectories is dropped, with a warning:
  GRPO compares a trajectory with the rest of its group, so a lone trajectory has advantage 0 and
  teaches nothing. The server also reports groups whose rewards are all equal (`groups_skipped`).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Iterable
from inspect import iscoroutine

from tqdm.auto import tqdm

from ._tasks import bounded, in_turn_of_finishing
from ._trajectory import Trajectory, TrajectoryGroup

__all__ = ["gather_trajectory_groups"]

logger = logging.getLogger("artlike")

_Outcome = tuple[int, int, Trajectory | Exception]  # (group index, position in group, result)


def exception_budget(max_exceptions: int | float, total: int) -> int:
    """How many failed rollouts are tolerated: an int is a count, a float in [0, 1] a fraction of `total`.

    >>> exception_budget(0, 64), exception_budget(3, 64), exception_budget(0.1, 64)
    (0, 3, 6)
    """
    if isinstance(max_exceptions, bool) or not isinstance(max_exceptions, int | float):
        raise TypeError(f"max_exceptions must be an int (a count) or a float (a fraction), not {max_exceptions!r}")
    if isinstance(max_exceptions, int):
        if max_exceptions < 0:
            raise ValueError(f"max_exceptions must be >= 0, got {max_exceptions}")
        return max_exceptions
    if not 0.0 <= max_exceptions <= 1.0:
        raise ValueError(f"a fractional max_exceptions must be in [0, 1], got {max_exceptions}")
    return math.floor(max_exceptions * total)


async def gather_trajectory_groups(
    groups: Iterable[TrajectoryGroup],
    *,
    concurrency: int | None = None,
    max_exceptions: int | float = 0,
    min_group_size: int = 2,
    progress: bool = True,
    pbar_desc: str = "rollouts",
) -> list[TrajectoryGroup]:
    """Await every rollout of every group and return the groups with their finished trajectories.

    `concurrency` caps how many rollouts run at once (None: all; awaitables that are already running
    tasks are not held back). See the module docstring for `max_exceptions` and `min_group_size`.
    The progress bar (`progress=False` hides it; `pbar_desc` is its label, ART's name for it) shows the
    live mean reward of finished rollouts and the number that failed.
    """
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1 or None, got {concurrency}")
    groups = list(groups)
    total = sum(len(group) for group in groups)
    budget = exception_budget(max_exceptions, total)
    limit = asyncio.Semaphore(concurrency) if concurrency is not None else None

    # slots[g][i]: the outcome of group g's i-th rollout (None while it runs), so groups keep their order.
    slots: list[list[Trajectory | Exception | None]] = []
    jobs: list[tuple[int, int, Awaitable[Trajectory]]] = []
    for index, group in enumerate(groups):
        slots.append([*group.trajectories, *(None for _ in group.pending)])
        jobs += [(index, len(group.trajectories) + n, awaitable) for n, awaitable in enumerate(group.pending)]

    bar = tqdm(total=total, desc=pbar_desc, unit="traj", disable=not progress)
    tracker = _Tracker(bar, budget, max_exceptions, total)
    try:
        async with in_turn_of_finishing(_run(index, position, awaitable, limit)
                                        for index, position, awaitable in jobs) as finished:
            for group in groups:
                for trajectory in group.trajectories:
                    tracker.record(trajectory)
            for next_done in finished:
                index, position, outcome = await next_done
                slots[index][position] = outcome
                tracker.record(outcome)
    finally:
        for _, _, awaitable in jobs:
            if iscoroutine(awaitable):
                awaitable.close()  # no-op once finished; a never-started one would warn "never awaited"
        bar.close()
    return _assemble(groups, slots, min_group_size)


async def _run(index: int, position: int, awaitable: Awaitable[Trajectory], limit: asyncio.Semaphore | None) -> _Outcome:
    try:
        async with bounded(limit):
            result = await awaitable
    except Exception as exc:  # a failed rollout is an outcome: counted by the policy, raised past the budget
        return index, position, exc
    if not isinstance(result, Trajectory):
        return index, position, TypeError(f"a rollout must return an artlike.Trajectory, got {type(result)!r}")
    return index, position, result


class _Tracker:
    """Counts outcomes, keeps the progress bar's mean reward live, and enforces the failure budget."""

    def __init__(self, bar: tqdm, budget: int, max_exceptions: int | float, total: int) -> None:
        self.bar, self.budget, self.max_exceptions, self.total = bar, budget, max_exceptions, total
        self.failures = 0
        self.rewards: list[float] = []

    def record(self, outcome: Trajectory | Exception) -> None:
        error = outcome if isinstance(outcome, Exception) else outcome.exception
        if error is not None:
            self.failures += 1
            if self.failures > self.budget:
                error.add_note(
                    f"artlike: {self.failures} of {self.total} rollouts failed, more than "
                    f"max_exceptions={self.max_exceptions!r} allows"
                )
                raise error
        elif isinstance(outcome, Trajectory) and outcome.reward is not None:
            self.rewards.append(outcome.reward)
        self.bar.update(1)
        postfix = {"reward": f"{sum(self.rewards) / len(self.rewards):.3f}"} if self.rewards else {}
        if self.failures:
            postfix["failed"] = str(self.failures)
        self.bar.set_postfix(postfix, refresh=False)


def _assemble(
    groups: list[TrajectoryGroup], slots: list[list[Trajectory | Exception | None]], min_group_size: int
) -> list[TrajectoryGroup]:
    kept: list[TrajectoryGroup] = []
    for group, outcomes in zip(groups, slots, strict=True):
        finished = [item for item in outcomes if isinstance(item, Trajectory) and not item.failed]
        exceptions = [*group.exceptions]
        for item in outcomes:
            error = item.exception if isinstance(item, Trajectory) else item
            if error is not None:
                exceptions.append(error)
        if len(finished) >= min_group_size:
            kept.append(TrajectoryGroup(finished, exceptions=exceptions))
    if len(kept) < len(groups):
        logger.warning(
            "artlike: dropped %d of %d groups left with fewer than %d trajectories (no GRPO signal)",
            len(groups) - len(kept), len(groups), min_group_size,
        )
    return kept
