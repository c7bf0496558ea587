"""Giving freed heap memory back to the operating system between commands.

A training step allocates gigabytes of activations and gradients in tensors below glibc's mmap threshold
(32 MiB at most), so they come from malloc's arenas; when the step ends they are free but glibc keeps the
pages, and the worker's resident size stays at its peak (11 GB after the email agent's integration test
step, 1.5 GB once trimmed). The trainer shares the machine with inference engines, which size their KV
caches from the memory still available, so the worker returns what it no longer uses after each command.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None)
    if trim is None:
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim  # type: ignore[no-any-return]


def release_supported() -> bool:
    """Whether this C library can give freed heap memory back (glibc can)."""
    return _malloc_trim() is not None


def release_freed_memory() -> bool:
    """Return the free pages of every malloc arena to the OS (`malloc_trim(0)`: the top of each heap and,
    with madvise, whole free pages inside it). True if memory was released; False if there was none to
    release or the C library cannot. Live allocations are untouched."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
