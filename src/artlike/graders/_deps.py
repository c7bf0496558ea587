"""Lazy imports of the optional `graders` extra: the library itself imports without any of them."""

from __future__ import annotations

import importlib
from types import ModuleType

from ._errors import MissingDependencyError


def require(module: str, package: str, what: str) -> ModuleType:
    """Import `module` (from PyPI `package`) or raise a MissingDependencyError naming the extra."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingDependencyError(package, what) from e
