"""bench/README.md's result tables are what `python -m bench.tables` generates from the result files."""

from __future__ import annotations

import json

import pytest

from bench import tables
from bench.machine import describe, instruction_sets


def test_the_readme_tables_are_generated_from_the_result_files() -> None:
    text = tables.README.read_text(encoding="utf-8")
    assert text == tables.generated(text), "run `python -m bench.tables` and commit bench/README.md"


def test_every_table_has_its_block() -> None:
    named = {block.group("name") for block in tables.BLOCK.finditer(tables.README.read_text(encoding="utf-8"))}
    assert named == set(tables.TABLES)


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
