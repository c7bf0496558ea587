"""The work of the text graders as plain functions of strings, named so that a caller may run them elsewhere.

`grade(..., compute=...)` hands every leaf computation to `compute(function, args)` instead of running it
here: the server runs them in worker processes it can kill, since ROUGE-L is quadratic in the texts' words,
the format regexes can backtrack quadratically, and math-verify may spend unbounded time in C code. Without
`compute` they run inline (`run_leaf`), which is what a rollout script wants.

    >>> run_leaf("string_check", ["Paris", "paris", "ilike"])
    1.0
    >>> run_leaf("format", ["<think>x</think><answer>4</answer>"])
    (1.0, '4')
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal

from ._format import format_reward
from ._math_accuracy import final_answer, math_equal
from ._string_check import string_check
from ._text_similarity import similarity

LeafFunction = Literal["string_check", "similarity", "math_accuracy", "format"]
LEAF_FUNCTIONS: tuple[LeafFunction, ...] = ("string_check", "similarity", "math_accuracy", "format")

_OPERATIONS: dict[str, Literal["eq", "ne", "like", "ilike"]] = {"eq": "eq", "ne": "ne", "like": "like", "ilike": "ilike"}

Compute = Callable[[LeafFunction, list[str]], Any | Awaitable[Any]]
"""Runs `run_leaf(function, args)` somewhere and gives (or awaits to) its result; a sequence result may come
back as a list (it crossed JSON)."""


def math_accuracy(output: str, reference: str, *, alarm_timeout_s: int | None = 5) -> tuple[float, str | None]:
    """(math_accuracy's score, the output's final answer)."""
    return math_equal(output, reference, alarm_timeout_s=alarm_timeout_s), final_answer(output)


def run_leaf(function: str, args: Sequence[str], *, alarm_timeout_s: int | None = 5) -> Any:
    """`function(*args)`: a score, or (score, extracted answer) for math_accuracy and format.

    `alarm_timeout_s` is math-verify's own time limit (SIGALRM, so main thread only, and blind to C code);
    None turns it off for a caller that bounds the call itself by killing the process."""
    if function == "string_check":
        input, reference, operation = args
        if operation not in _OPERATIONS:
            raise ValueError(f"unknown string_check operation {operation!r}")
        return string_check(input, reference, _OPERATIONS[operation])
    if function == "similarity":
        input, reference, metric = args
        return similarity(input, reference, metric)
    if function == "math_accuracy":
        output, reference = args
        return math_accuracy(output, reference, alarm_timeout_s=alarm_timeout_s)
    if function == "format":
        (text,) = args
        return format_reward(text)
    raise ValueError(f"unknown grader function {function!r}")
