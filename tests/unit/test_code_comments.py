"""Code says what is; design notes, the changelog and the benches say why, when and how fast.

Comments, docstrings and CLI help in the shipped code (server, client, benches, examples, Makefile) cite no
design-document section, no issue number and no measured run time: the repository has no design document,
an issue number means nothing without its link, and a quoted timing goes stale while the bench that
measures it stays current. Links are fine (`# See: https://github.com/encode/httpx/issues/771`).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCANNED_DIRECTORIES = ("server", "src", "bench", "examples")
SCANNED_FILES = ("Makefile",)
# Their help text and defaults are being moved into one settings source, which drops these citations.

URL = re.compile(r"https?://\S+")
CITATION = re.compile(
    r"DESIGN\s*§"  # a section of a design document
    r"|DESIGN\.md"
    r"|\b(?:issue|issues|PR|PRs|pull request)\s*#?\d+"  # "issue #11", "Issue 17 asks", "PR #48421"
    r"|[A-Za-z]#\d+\b"  # "vllm#42125"
    r"|\(#\d+\b",  # "(#18)"
    re.IGNORECASE,
)
TIMING = re.compile(
    r"\d(?:\.\d+)?\s?[x×] (?:as )?(?:fast|slow)"  # "1.54x as fast", "2.65× faster"
    r"|~\d+(?:\.\d+)?\s?(?:µs|ms|s|sec|seconds|min|minutes|h|hours)\b"  # "~52 min", "~30 ms"
    r"|\babout (?:a|\d+(?:\.\d+)?) (?:second|minute)s?\b"  # "about a minute"
    r"|\d\s?(?:ms|s|min|minutes) on \d+[- ]?(?:CPU )?cores?\b",  # "18 s on 2 cores"
    re.IGNORECASE,
)


def scanned_files() -> list[Path]:
    files = [path for directory in SCANNED_DIRECTORIES for path in sorted((REPO / directory).rglob("*.py"))]
    files += [REPO / name for name in SCANNED_FILES]
    return files


def offending_lines(pattern: re.Pattern[str]) -> list[str]:
    found = []
    for path in scanned_files():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if pattern.search(URL.sub("", line)):
                found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    return found


def test_the_scan_covers_the_shipped_code() -> None:
    names = {path.relative_to(REPO).as_posix() for path in scanned_files()}
    assert {"server/artlike_server/app.py", "src/artlike/__init__.py", "bench/rl_step.py", "Makefile"} <= names
    assert any(name.startswith("examples/") for name in names)


def test_no_design_section_or_issue_number_is_cited() -> None:
    assert offending_lines(CITATION) == []


def test_no_measured_timing_is_quoted() -> None:
    assert offending_lines(TIMING) == []


@pytest.mark.parametrize("line", [
    "# see DESIGN §8", "(DESIGN.md, section 3)", "Consistency (issue #18: never serve mixed steps):",
    "Issue 17 asks for more", "(upstream vllm PRs #48421 and #49656)", "stale results, vllm#42125)",
    '"""Scale-out (#18): what one proxy carries."""',
])
def test_citations_are_recognised(line: str) -> None:
    assert CITATION.search(URL.sub("", line)) is not None


@pytest.mark.parametrize("line", [
    "# See: https://github.com/encode/httpx/issues/771",
    "(https://github.com/vllm-project/vllm/pull/48421)",
    "the color #ffcc00", "step #3 of the plan", "bound = 4  # PR-free",
])
def test_links_and_other_hashes_are_not_citations(line: str) -> None:
    assert CITATION.search(URL.sub("", line)) is None


@pytest.mark.parametrize("line", [
    "(rollouts 1.54x as fast on 2 CPU cores)", "decodes 2.65× faster", "~52 min on 2 cores",
    "Starting it costs about a minute", "one epoch (18 s on 2 cores)", "a client costs ~1 ms",
])
def test_timings_are_recognised(line: str) -> None:
    assert TIMING.search(line) is not None


@pytest.mark.parametrize("line", [
    "Targets: added p50 latency ≤ 2 ms.", "`EMULATED_RATIO` (20x) slower", "timeout_s: float = 5.0",
    "the server sends a heartbeat every 10 s", 'print(f"{seconds:.1f} s")',
])
def test_constants_and_targets_are_not_timings(line: str) -> None:
    assert TIMING.search(line) is None
