"""The client's sync API, generated from its async one: a `_sync` call runs the async call on a private loop.

Every HTTP route is written once, async (`_backend.Backend`). `syncify(method)` makes its sync variant:
the same parameters, the coroutine run to completion by `run_sync`; `iterate_sync` does the same for an
async iterator, one item at a time. The private loop is the calling thread's own when no loop runs there,
else a helper thread's, so sync calls work in scripts, in notebooks and inside async code alike (they
block their caller, as sync calls do). Inside one, `in_sync_call()` is True: the connection then sends
through the sync transport and waits between retries with the retry policy's `sync_sleep`.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import AsyncIterator, Callable, Coroutine, Generator
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Any, ParamSpec, TypeVar

__all__ = ["in_sync_call", "iterate_sync", "run_sync", "syncify"]

_P = ParamSpec("_P")
_T = TypeVar("_T")

_SYNC_CALL: contextvars.ContextVar[bool] = contextvars.ContextVar("artlike_sync_call", default=False)


def in_sync_call() -> bool:
    """True while a `_sync` call runs its coroutine."""
    return _SYNC_CALL.get()


def run_sync(coroutine: Coroutine[Any, Any, _T]) -> _T:
    """The coroutine's result, computed on a private event loop (see the module docstring)."""
    with _PrivateLoop() as loop:
        return loop.run(coroutine)


def iterate_sync(iterator: AsyncIterator[_T]) -> Generator[_T, None, None]:
    """The items of an async iterator, each computed on one private event loop kept for the whole iteration
    (an open HTTP stream belongs to the loop that opened it). Closing the generator closes the iterator."""
    with _PrivateLoop() as loop:
        try:
            while True:
                try:
                    item = loop.run(_next(iterator))
                except StopAsyncIteration:
                    return
                yield item
        finally:
            close = getattr(iterator, "aclose", None)
            if close is not None:
                loop.run(close())


def syncify(function: Callable[_P, Coroutine[Any, Any, _T]], *, doc: str | None = None) -> Callable[_P, _T]:
    """The sync variant of an async function or method: same parameters, the result instead of a coroutine;
    its docstring is the async one's unless `doc` says otherwise.

        class TrainableModel:
            async def get_info(self) -> ModelInfo: ...
            get_info_sync = syncify(get_info)
    """

    @functools.wraps(function)
    def call(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        return run_sync(function(*args, **kwargs))

    call.__name__ = f"{function.__name__}_sync"
    call.__qualname__ = f"{function.__qualname__}_sync"
    if doc is not None:
        call.__doc__ = doc
    return call


async def _next(iterator: AsyncIterator[_T]) -> _T:
    return await anext(iterator)


class _PrivateLoop:
    """An `asyncio.Runner` for one sync call: on this thread, or on a helper thread when this thread is
    running a loop already (a loop cannot run inside another on the same thread)."""

    def __init__(self) -> None:
        self._context = contextvars.copy_context()
        self._context.run(_SYNC_CALL.set, True)
        self._runner = asyncio.Runner()
        self._helper: ThreadPoolExecutor | None = None

    def __enter__(self) -> _PrivateLoop:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return self
        self._helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="artlike-sync")
        return self

    def run(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        if self._helper is None:
            return self._runner.run(coroutine, context=self._context)
        return self._helper.submit(self._runner.run, coroutine, context=self._context).result()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if self._helper is None:
            self._runner.close()
            return
        try:
            self._helper.submit(self._runner.close).result()
        finally:
            self._helper.shutdown()
