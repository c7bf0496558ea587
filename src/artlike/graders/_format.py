"""SeekrFlow's format reward: the output must be `<think>…</think><answer>…</answer>` and nothing else.

    >>> format_reward("<think>4 and 14: lcm</think> <answer>28</answer>")
    (1.0, '28')
    >>> format_reward("28")
    (0.0, None)
    >>> format_reward("Let me see. <answer>28</answer>")  # wrong format, but the answer is still found
    (0.0, '28')
"""

from __future__ import annotations

import re

_STRICT = re.compile(r"\s*<think>.*?</think>\s*<answer>(.*?)</answer>\s*", re.DOTALL)
_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(text: str) -> str | None:
    """The last `<answer>…</answer>` content, stripped; None when there is none."""
    answers = _ANSWER.findall(text)
    return answers[-1].strip() if answers else None


def format_reward(text: str) -> tuple[float, str | None]:
    """(1.0 if the whole text has the format else 0.0, the extracted answer)."""
    m = _STRICT.fullmatch(text)
    # fullmatch's lazy groups can still stretch across a second tag pair: refuse those.
    if m is not None and not any(tag in m.group(1) for tag in _TAGS):
        return 1.0, m.group(1).strip()
    return 0.0, extract_answer(text)
