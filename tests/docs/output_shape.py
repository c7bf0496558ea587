"""Does what a block printed have the shape of the output its doc pastes? Samples, ids and numbers vary.

Each pasted line is `label: value`. The printed output must have a line with the same label; where the
pasted value holds numbers, booleans or None, both lines must match with every number read as N (so
`[0.03, 0.01]` and `[0.5, 0.2]` agree, `True` and `False` do not); free text (a sampled answer) only needs
its label.
"""

from __future__ import annotations

import re

NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
STRUCTURED = re.compile(r"\d|\bTrue\b|\bFalse\b|\bNone\b")


def label(line: str) -> str:
    return line.split(":", 1)[0].strip()


def shape(line: str) -> str:
    return NUMBER.sub("N", line.strip())


def mismatches(pasted: str, printed: str) -> list[str]:
    printed_lines = {label(line): line for line in reversed(printed.splitlines()) if ":" in line}
    problems = []
    for line in pasted.splitlines():
        if not line.strip():
            continue
        twin = printed_lines.get(label(line))
        if twin is None:
            problems.append(f"no printed line labelled {label(line)!r} (pasted: {line!r})")
        elif STRUCTURED.search(line.split(":", 1)[-1]) and shape(twin) != shape(line):
            problems.append(f"printed {twin!r}, pasted {line!r}")
    return problems
