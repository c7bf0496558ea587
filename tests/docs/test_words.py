"""The docs describe the product, not how it got here (that is CHANGELOG.md's job).

No page cites an issue or a design document, names a run by letter or date, or narrates history ("used
to", "no longer", "since then", an earlier run); "session" means a training session (or the studio's login
session), never a stretch of our own work. The same citations are kept out of code by
tests/unit/test_code_comments.py. Inline code, quoted strings and URLs are not prose and are not scanned.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.docs.doc_files import doc_files, relative
from tests.unit.test_code_comments import CITATION

NOT_PROSE = re.compile(r"https?://\S+|`[^`\n]*`|\"[^\"\n]*\"")
FORBIDDEN = {
    "a citation": CITATION,
    "an issue number": re.compile(r"(?<![\w/&])#\d+\b"),
    "a run letter": re.compile(r"\b[Rr]uns?\s+[A-E](?:\s*[–-]\s*[A-E])?\b"),
    "a history word": re.compile(r"\bused to\b|\bno longer\b|\bsince then\b|\ban? (?:earlier|previous) run\b"
                                 r"|\bthe issue'?s\b", re.IGNORECASE),
    "a session of our own work": re.compile(
        r"\b(?:this|our|earlier|previous|later|last|next|helper|work|coding|agent) sessions?\b", re.IGNORECASE),
    "the date of a run": re.compile(
        r"\b20\d\d-\d\d-\d\d\b|\b(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*\.? (?:\d{1,2},? )?20\d\d\b"),
}

def offending(line: str) -> list[str]:
    prose = NOT_PROSE.sub("", line)
    return [what for what, pattern in FORBIDDEN.items() if pattern.search(prose)]


def offences(path: Path) -> list[str]:
    lines = enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
    return [f"{relative(path)}:{number}: {what}: {line.strip()}" for number, line in lines for what in offending(line)]


@pytest.mark.parametrize("path", doc_files(), ids=relative)
def test_docs_are_product_docs(path: Path) -> None:
    assert offences(path) == []


@pytest.mark.parametrize("line", [
    "see issue 12", "as #17 asks", "described in DESIGN.md", "Run A measured", "runs A–E",
    "the proxy used to buffer", "it no longer retries", "in an earlier run", "this session added",
    "measured on 2026-11-27", "measured in November 2026", "the issue's bar",
])
def test_offences_are_recognised(line: str) -> None:
    assert len(offending(line)) == 1


@pytest.mark.parametrize("line", [
    "a training session holds a model", "open a new session on the model", "the session cookie",
    "dates (`2024-03-14`) are one date", 'as "14 March 2024"', "the color #ffcc00",
    "[link](https://github.com/x/y/issues/12)", "the key is used by the engine", "runs a job",
])
def test_product_words_pass(line: str) -> None:
    assert offending(line) == []
