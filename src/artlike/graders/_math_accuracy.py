"""math_accuracy: 1.0 if the output's final answer equals the reference mathematically, else 0.0.

The final answer is the last `\\boxed{…}`, else the last `<answer>…</answer>`, else the last number.
`math-verify` then compares it with the reference (fractions, LaTeX, 0.5 == 1/2, units and `%` handled).
An output with no parseable answer scores 0; it is not an error.

    >>> final_answer(r"so $x = \\boxed{\\frac{1}{2}}$.")
    '\\\\frac{1}{2}'
    >>> final_answer("<think>4*7</think><answer>28</answer>"), final_answer("It is 3, no wait: 1,000.")
    ('28', '1,000')
    >>> math_equal("<answer>0.5</answer>", r"\\frac{1}{2}")
    1.0
"""

from __future__ import annotations

import re
import threading
from typing import Any

from ._deps import require
from ._format import extract_answer

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?%?|-?\.\d+%?")
_BOXED = "\\boxed{"


def _last_boxed(text: str) -> str | None:
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, i = 1, start + len(_BOXED)
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None  # unbalanced braces: no boxed answer


def _find_answer(text: str) -> tuple[str | None, bool]:
    """(the final answer, whether it came from `\\boxed{}`)."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed, True
    tagged = extract_answer(text)
    if tagged is not None:
        return tagged, False
    numbers = _NUMBER.findall(text)
    return (numbers[-1] if numbers else None), False


def final_answer(text: str) -> str | None:
    return _find_answer(text)[0]


def _parse(text: str, timeout_s: int | None) -> list[Any]:
    mv = require("math_verify", "math-verify", "the math_accuracy grader")
    parsed: list[Any] = mv.parse(text, parsing_timeout=timeout_s)
    return parsed


def _alarm_timeout(requested: int | None) -> int | None:
    # math-verify's timeouts use SIGALRM, which only the main thread may set; in other threads parsing is
    # unbounded, so a caller that needs a time limit there runs graders in a process it can kill.
    return requested if threading.current_thread() is threading.main_thread() else None


def math_equal(output: str, reference: str, *, alarm_timeout_s: int | None = 5) -> float:
    """1.0 if `output`'s final answer equals `reference` (itself parsed as a whole), else 0.0.

    `alarm_timeout_s`: math-verify's own per-step limit (SIGALRM: main thread only, and it cannot interrupt
    C code); None turns it off, for a caller that bounds the whole call by killing its process."""
    answer, boxed = _find_answer(output)
    if answer is None:
        return 0.0
    timeout = _alarm_timeout(alarm_timeout_s)
    # Boxed again, a LaTeX answer keeps its LaTeX meaning: bare, `50\%` would read as 50, not 0.5.
    pred = _parse(_BOXED + answer + "}" if boxed else answer, timeout)
    gold = _parse(reference, timeout)
    if not gold or not pred:
        return 0.0
    mv = require("math_verify", "math-verify", "the math_accuracy grader")
    return 1.0 if mv.verify(gold, pred, timeout_seconds=timeout) else 0.0
