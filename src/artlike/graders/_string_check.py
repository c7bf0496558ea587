"""string_check: 1.0 if the operation holds between the rendered input and reference, else 0.0.

    >>> string_check("Paris", "Paris", "eq"), string_check("Paris", "paris", "eq")
    (1.0, 0.0)
    >>> string_check("The capital is PARIS.", "paris", "ilike"), string_check("xyz", "Paris", "ne")
    (1.0, 1.0)
"""

from __future__ import annotations

from typing import Literal


def string_check(input: str, reference: str, operation: Literal["eq", "ne", "like", "ilike"]) -> float:
    if operation == "eq":
        ok = input == reference
    elif operation == "ne":
        ok = input != reference
    elif operation == "like":  # contains
        ok = reference in input
    else:  # ilike: case-insensitive contains
        ok = reference.casefold() in input.casefold()
    return 1.0 if ok else 0.0
