"""The docs' Python and shell blocks as Sybil examples: a fragment must compile, any other block runs.

A runnable block runs in a subprocess (`bash -euo pipefail`, or this venv's python), from the repository
root, with the environment the docs promise: `ARTLIKE_SERVER` (the server's root URL, no `/v1`) and
`ARTLIKE_API_KEY`. The test that runs them puts that environment in the document's namespace under
`RUN_ENV`; what each block printed is kept there under `OUTPUTS`, by line.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tempfile
from pathlib import Path

from sybil import Document, Example
from sybil.parsers.markdown import CodeBlockParser

from tests.docs.doc_files import PYTHON_LANGUAGES, REPO, SHELL_LANGUAGES, is_fragment, relative

RUN_ENV = "run_env"
OUTPUTS = "outputs"
BLOCK_TIMEOUT_S = 300


class BlockFailed(AssertionError):
    pass


def language(example: Example) -> str:
    return str(example.region.lexemes["arguments"])


def where(example: Example) -> str:
    return f"{relative(example.path)}:{example.line}"


def shell_source(example: Example) -> str:
    """A `console` block's commands are its `$ ` lines; the rest is their output."""
    source = str(example.parsed)
    if language(example) != "console":
        return source
    return "\n".join(line[2:] for line in source.splitlines() if line.startswith("$ "))


def check_fragment(example: Example) -> None:
    if language(example) in PYTHON_LANGUAGES:
        compile(str(example.parsed), where(example), "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        return
    checked = subprocess.run(["bash", "-n"], input=shell_source(example), capture_output=True, text=True,
                             check=False)
    if checked.returncode != 0:
        raise BlockFailed(f"{where(example)}: bash -n: {checked.stderr}")


def run_block(example: Example) -> None:
    env = example.namespace.get(RUN_ENV)
    if env is None:
        raise BlockFailed(f"{where(example)} runs against a server: evaluate it from the integration test")
    with tempfile.TemporaryDirectory() as scratch:
        if language(example) in PYTHON_LANGUAGES:
            script = Path(scratch) / "block.py"
            script.write_text(str(example.parsed), encoding="utf-8")
            command = [sys.executable, str(script)]
        else:
            command = ["bash", "-euo", "pipefail", "-c", shell_source(example)]
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=BLOCK_TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise BlockFailed(f"{where(example)} exited {done.returncode}\n--- stdout\n{done.stdout}\n"
                          f"--- stderr\n{done.stderr}")
    example.namespace.setdefault(OUTPUTS, {})[example.line] = done.stdout


def evaluate(example: Example) -> None:
    if is_fragment(str(example.parsed)):
        check_fragment(example)
    else:
        run_block(example)


PARSERS = [CodeBlockParser(language=name, evaluator=evaluate) for name in (*PYTHON_LANGUAGES, *SHELL_LANGUAGES)]


def parse(path: Path) -> Document:
    return Document.parse(str(path), *PARSERS)


def examples(path: Path) -> list[Example]:
    return list(parse(path))
