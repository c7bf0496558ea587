"""Run awaitables concurrently and take their results as they finish: the loop that rollouts
(`gather_trajectory_groups`) and judging (`judge_groups`) share."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Iterable, Iterator
from contextlib import asynccontextmanager
from typing import Any, TypeVar

__all__ = ["bounded", "in_turn_of_finishing"]

_T = TypeVar("_T")


@asynccontextmanager
async def in_turn_of_finishing(awaitables: Iterable[Awaitable[_T]]) -> AsyncIterator[Iterator[Awaitable[_T]]]:
    """Starts every awaitable as a task and gives `asyncio.as_completed` over them. However the block ends
    (done, an exception, a break), the tasks still running are cancelled and waited for, so none outlives it.

        async with in_turn_of_finishing(work(item) for item in items) as finished:
            for next_done in finished:
                result = await next_done
    """
    tasks = [asyncio.ensure_future(awaitable) for awaitable in awaitables]
    try:
        yield asyncio.as_completed(tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def bounded(limit: asyncio.Semaphore | None) -> contextlib.AbstractAsyncContextManager[Any]:
    """`async with bounded(limit):` holds one of `limit`'s slots, or none when there is no limit."""
    return limit if limit is not None else contextlib.nullcontext()
