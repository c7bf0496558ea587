"""Durability of names: fsync of a file's bytes does not make its creation, rename or removal durable;
that takes an fsync of the directory holding it."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_directory(directory: Path) -> None:
    """Make the entries of `directory` (files created, renamed into it, removed) survive a power loss."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
