"""Every relative link of the docs names a file that exists, and every `#anchor` a heading of its target;
every repository path in inline code (`bench/results/*.json`, `artlike/_errors.py`) names a file too.

Anchors follow GitHub's rules: a heading's text, lowercased, punctuation other than `-` and `_` dropped,
each space a `-`, and `-1`, `-2`, ... after repeats; `<a id="...">` tags are anchors too.
"""

from __future__ import annotations

import re
from collections import Counter
from functools import cache
from itertools import pairwise
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from markdown_it import MarkdownIt
from markdown_it.token import Token

from tests.docs.doc_files import REPO, doc_files, relative

# A path with a directory and a file extension, as inline code; `*` may stand for a name.
FILE_PATH = re.compile(r"`((?:[\w.-]+/)+[\w.*-]+\.(?:py|md|json|jsonl|toml|sh|txt|yaml|yml|ts|js|html))`")
# Where a doc's paths start: the repository, the doc's own folder, or a package's folder.
PATH_ROOTS = (REPO, REPO / "src", REPO / "server", REPO / "src" / "artlike", REPO / "server" / "artlike_server")
HTML_ID = re.compile(r"""<a\s[^>]*\b(?:id|name)=["']([^"']+)["']""")


def slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def plain_text(inline: Token) -> str:
    return "".join(child.content for child in inline.children or [] if child.type in ("text", "code_inline"))


@cache
def anchors(path: Path) -> frozenset[str]:
    text = path.read_text(encoding="utf-8")
    tokens = MarkdownIt("commonmark").parse(text)
    seen: Counter[str] = Counter()
    found = set(HTML_ID.findall(text))
    for opening, inline in pairwise(tokens):
        if opening.type == "heading_open":
            base = slug(plain_text(inline))
            found.add(base if seen[base] == 0 else f"{base}-{seen[base]}")
            seen[base] += 1
    return frozenset(found)


def links(path: Path) -> list[str]:
    tokens = MarkdownIt("commonmark").parse(path.read_text(encoding="utf-8"))
    return [str(child.attrs["href"]) for token in tokens for child in token.children or []
            if child.type == "link_open"]


def broken_links(path: Path) -> list[str]:
    broken = []
    for href in links(path):
        parts = urlsplit(href)
        if parts.scheme or parts.netloc:
            continue
        target = (path.parent / unquote(parts.path)).resolve() if parts.path else path
        if not target.exists() or not (target.is_relative_to(REPO) or target == path):
            broken.append(f"{href}: no file {target}")
        elif parts.fragment and target.suffix == ".md" and unquote(parts.fragment) not in anchors(target):
            broken.append(f"{href}: no heading #{parts.fragment} in {target.name}")
    return broken


def missing_files(path: Path) -> list[str]:
    named = FILE_PATH.findall(path.read_text(encoding="utf-8"))
    return [name for name in named if not any(any(root.glob(name)) for root in (*PATH_ROOTS, path.parent))]


@pytest.mark.parametrize("path", doc_files(), ids=relative)
def test_named_files_exist(path: Path) -> None:
    assert missing_files(path) == []


@pytest.mark.parametrize("path", doc_files(), ids=relative)
def test_links_resolve(path: Path) -> None:
    assert broken_links(path) == []


def test_broken_links_are_found(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](#title) [file](missing.md) [anchor](#nope) [web](https://x.org/#y)\n")
    assert [problem.split(":")[0] for problem in broken_links(page)] == ["missing.md", "#nope"]


def test_missing_files_are_found(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("`bench/results/*.json`, `artlike/_errors.py`, `bench/results/none.json`, `/v1/models`\n")
    assert missing_files(page) == ["bench/results/none.json"]


@pytest.mark.parametrize(("heading", "anchor"), [
    ("Which door?", "which-door"),
    ("The training policy from merged weights (`--policy-engines`)",
     "the-training-policy-from-merged-weights---policy-engines"),
    ("RL step: sequential loop vs pipeline", "rl-step-sequential-loop-vs-pipeline"),
    ("snake_case and 1.5×", "snake_case-and-15"),
])
def test_slugs_follow_github(heading: str, anchor: str) -> None:
    assert slug(heading) == anchor
