"""The result tables of bench/README.md and the examples' READMEs are what `python -m bench.tables` generates
from the result files."""

from __future__ import annotations

import doctest
import json
from pathlib import Path

import pytest

from bench import tables
from bench.machine import describe, instruction_sets


@pytest.mark.parametrize("document", sorted(tables.documents()), ids=lambda path: str(path.relative_to(tables.ROOT)))
def test_the_tables_are_generated_from_the_result_files(document: Path) -> None:
    text = document.read_text(encoding="utf-8")
    assert text == tables.generated(text), f"run `python -m bench.tables` and commit {document}"


@pytest.mark.parametrize("document", sorted(tables.documents()), ids=lambda path: str(path.relative_to(tables.ROOT)))
def test_every_table_has_its_block(document: Path) -> None:
    named = {block.group("name") for block in tables.BLOCK.finditer(document.read_text(encoding="utf-8"))}
    assert named == tables.documents()[document]


def test_the_example_results_name_their_machine() -> None:
    for path in tables.EMAIL_AGENT_RESULTS:
        machine = json.loads(path.read_text(encoding="utf-8"))["machine"]
        assert describe(machine) in tables.render("email_agent")


@pytest.mark.parametrize("name", sorted(tables.TABLES))
def test_each_result_names_its_machine(name: str) -> None:
    result_file, _ = tables.TABLES[name]
    machine = json.loads((tables.RESULTS / result_file).read_text(encoding="utf-8"))["machine"]
    assert machine["cpu"] and machine["isa"]
    assert describe(machine) in tables.render(name)


def test_instruction_sets() -> None:
    assert instruction_sets(frozenset({"avx2", "avx512f", "avx512_bf16"})) == "AVX-512 with BF16"
    assert instruction_sets(frozenset({"avx2"})) == "AVX2, no native BF16"
    assert describe({"cpu": "AMD EPYC", "cores": 2, "isa": "AVX2"}) == "AMD EPYC, 2 cores, AVX2"


def test_the_difference_margin_worked_examples() -> None:
    assert doctest.testmod(tables, raise_on_error=True).attempted >= 2
    # Two accuracies of 0.59 and 0.40 over 200 problems each: 1.96·√((0.59·0.41 + 0.40·0.60)/200) = 0.0962.
    assert tables.difference_margin(0.59, 0.40, 200) == pytest.approx(0.0962, abs=1e-4)
