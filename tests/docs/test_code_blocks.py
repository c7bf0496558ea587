"""Every Python and shell block of the docs either runs against the real server or is a marked fragment.

A block is run unless its first line is `# fragment` (then it must still compile, or pass `bash -n`). A
`text` block right after a runnable block is what that block prints: the run checks its shape.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from artlike_server.launcher import ServerProcess
from sybil import Example

from tests.docs import code_blocks, output_shape
from tests.docs.doc_files import (
    PYTHON_LANGUAGES,
    REPO,
    SHELL_LANGUAGES,
    Fence,
    doc_files,
    fences,
    is_fragment,
    relative,
)

CODE_LANGUAGES = {*PYTHON_LANGUAGES, *SHELL_LANGUAGES}
# Shown, never run: data, config, output and other languages' code.
OTHER_LANGUAGES = {"text", "json", "jsonl", "toml", "yaml", "ini", "typescript", "ts", "javascript", "diff"}


def example_ids(examples: list[Example]) -> list[str]:
    return [code_blocks.where(example) for example in examples]


EXAMPLES = [example for path in doc_files() for example in code_blocks.examples(path)]
FRAGMENTS = [example for example in EXAMPLES if is_fragment(str(example.parsed))]
RUNNABLE = [example for example in EXAMPLES if not is_fragment(str(example.parsed))]


def test_the_docs_have_blocks_of_both_kinds() -> None:
    assert "README.md" in {relative(example.path) for example in RUNNABLE}
    assert len(FRAGMENTS) > 10


@pytest.mark.parametrize("path", doc_files(), ids=relative)
def test_every_code_block_is_collected(path: Path) -> None:
    """Sybil finds each Python and shell fence that CommonMark sees, and no fence is in a language we
    neither run nor know to be data."""
    found = fences(path)
    unknown = [f"{fence.where} ({fence.language or 'no language'})" for fence in found
               if fence.language not in CODE_LANGUAGES | OTHER_LANGUAGES]
    assert unknown == [], "label the block with its language (python, bash, text, json, ...)"
    code_lines = {fence.line for fence in found if fence.language in CODE_LANGUAGES}
    assert {example.line for example in code_blocks.examples(path)} == code_lines


@pytest.mark.parametrize("example", FRAGMENTS, ids=example_ids(FRAGMENTS))
def test_fragment_compiles(example: Example) -> None:
    example.evaluate()


@pytest.mark.parametrize(("source", "fragment"), [
    ("# fragment\nx = 1\n", True), ("# fragment: groups are yours\nawait f()\n", True),
    ("import os\n# fragment\n", False), ("# fragmentary\n", False),
])
def test_the_fragment_mark(source: str, fragment: bool) -> None:
    assert is_fragment(source) is fragment


def pasted_output(example: Example) -> Fence | None:
    later = [fence for fence in fences(Path(example.path)) if fence.line > example.line]
    return later[0] if later and later[0].language == "text" else None


def test_the_quickstart_runs_and_shows_its_output() -> None:
    quickstart = [example for example in RUNNABLE
                  if relative(example.path) == "README.md" and "model.train(" in str(example.parsed)]
    assert len(quickstart) == 1 and pasted_output(quickstart[0]) is not None


def test_output_shapes_compare_labels_and_numbers() -> None:
    pasted = "rewards: [0.03, 0.01]\ntrained: True | served: q@1 | reason: None\nnew step says: Hi there"
    assert output_shape.mismatches(pasted, "rewards: [0.5, 1e-05]\ntrained: True | served: q@12 | "
                                           "reason: None\nnew step says: Hello\nmore text") == []
    assert len(output_shape.mismatches(pasted, "rewards: [0.5]\ntrained: False | served: q@0 | reason: None"
                                                "\nnew step: x")) == 3


def docs_env(server: ServerProcess) -> dict[str, str]:
    """What a reader's shell has after the README's setup: the server variables and the venv first on PATH."""
    python_path = os.pathsep.join(filter(None, [str(REPO / "src"), str(REPO / "server"), str(REPO),
                                                os.environ.get("PYTHONPATH")]))
    return dict(os.environ, ARTLIKE_SERVER=server.base_url, ARTLIKE_API_KEY=server.api_key or "",
                PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
                PYTHONPATH=python_path)


@pytest.mark.integration
@pytest.mark.parametrize("example", RUNNABLE, ids=example_ids(RUNNABLE))
def test_block_runs(example: Example, server: ServerProcess) -> None:
    example.namespace[code_blocks.RUN_ENV] = docs_env(server)
    example.evaluate()
    pasted = pasted_output(example)
    if pasted is not None:
        printed = example.namespace[code_blocks.OUTPUTS][example.line]
        assert output_shape.mismatches(pasted.source, printed) == [], printed


@pytest.mark.parametrize("path", doc_files(), ids=relative)
def test_json_blocks_parse(path: Path) -> None:
    """A `json` block is a body as sent or received; a sketch with `...` or a request line is `text`."""
    for fence in fences(path):
        if fence.language == "json":
            json.loads(fence.source)
        elif fence.language == "jsonl":
            [json.loads(line) for line in fence.source.splitlines() if line.strip()]
