"""The documentation that the tests in this folder keep true, and its fenced code blocks."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from markdown_it import MarkdownIt

REPO = Path(__file__).resolve().parents[2]
# Every page a user reads: the top-level README, docs/, the examples' READMEs and the packages' READMEs.
DOC_PATTERNS = ("README.md", "docs/**/*.md", "examples/*/README.md", "client/README.md",
                "src/artlike/README.md", "bench/README.md")

PYTHON_LANGUAGES = ("python", "py")
SHELL_LANGUAGES = ("bash", "sh", "shell", "console")
# A block whose first line is this comment (optionally followed by ": why") is shown, not run.
FRAGMENT_MARK = "# fragment"


def doc_files() -> list[Path]:
    return sorted({path for pattern in DOC_PATTERNS for path in REPO.glob(pattern)})


def relative(path: Path | str) -> str:
    return Path(path).resolve().relative_to(REPO).as_posix()


@dataclass(frozen=True)
class Fence:
    """A fenced block as CommonMark sees it: its file, 1-based line of the opening fence, language, text."""

    path: Path
    line: int
    language: str
    source: str

    @property
    def where(self) -> str:
        return f"{relative(self.path)}:{self.line}"


def fences(path: Path) -> list[Fence]:
    tokens = MarkdownIt("commonmark").parse(path.read_text(encoding="utf-8"))
    return [Fence(path, token.map[0] + 1 if token.map else 0, (token.info.split() or [""])[0], token.content)
            for token in tokens if token.type == "fence"]


def is_fragment(source: str) -> bool:
    first_line = source.lstrip("\n").split("\n", 1)[0].strip()
    return first_line == FRAGMENT_MARK or first_line.startswith(FRAGMENT_MARK + ":")
