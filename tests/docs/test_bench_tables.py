"""The result tables of bench/README.md and the examples' READMEs are what `python -m bench.tables` generates
from the result files."""

from __future__ import annotations

import doctest
import json
from pathlib import Path

import pytest

from bench import tables
from bench.machine import describe, instruction_sets
from examples.arithmetic.task import HELD_OUT_SEED, TRAINING_SEED, problems


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


def test_a_plateau_row_is_read_against_its_own_runs_baseline() -> None:
    def run(before: str, after: str) -> dict[str, object]:
        def point(right: str, minutes: float | None = None) -> dict[str, object]:
            accuracy = right.count("1") / len(right)
            values = {"greedy": accuracy, "sampled": accuracy, "greedy_right": right}
            return values if minutes is None else {**values, "minutes": minutes, "steps": 3}
        return {"before": point(before), "checkpoints": [point(after, 15.0)]}

    result = {"settings": {"checkpoints": [15.0], "pool_size": 8, "eval_size": 4}, "ceiling_greedy": None,
              "machine": {"cpu": "AMD EPYC", "cores": 2, "isa": "AVX2"},
              "runs": {"baseline": run("0000", "1000"), "curriculum": run("0000", "1100")}}
    rendered = tables.plateau("plateau_test.json")(result)
    # paired: differences 0, 1, 0, 0 give +25 points ± 1.96·√(0.25/4) = 49 points
    # held-out problems 0, 1 and 3 are not among the 8 training problems: 2 of those 3 right
    # no per-step reports: no seconds a step
    assert "| `curriculum` | 0.0% / 0.0% | 50.0% / 50.0% | 66.7% of 3 | 3 | — | — | — | +25.0 ± 49.0 points |" in rendered
    for point in (*result["runs"]["baseline"]["checkpoints"], *result["runs"]["curriculum"]["checkpoints"]):
        del point["greedy_right"]
    # without the answers: as if independent, 1.96·√((0.5·0.5 + 0.25·0.75)/4) = 64.8 points
    assert "+25.0 ± 64.8 points" in tables.plateau("plateau_test.json")(result)


def test_the_unseen_held_out_problems_are_those_the_training_pool_lacks() -> None:
    pool, held_out = set(problems(TRAINING_SEED, 1024)), problems(HELD_OUT_SEED, 200)
    indices = tables.unseen(1024, 200)
    assert [i for i, problem in enumerate(held_out) if problem not in pool] == list(indices)
    assert 0 < len(indices) < 200
    right = "".join("0" if i in indices else "1" for i in range(200))
    assert tables.unseen_accuracy({"greedy_right": right}, {"pool_size": 1024, "eval_size": 200}) == "0.0% of 44"
    assert tables.unseen_accuracy({"greedy": 0.5}, {"pool_size": 1024, "eval_size": 200}) == "—"


def test_a_plateau_table_names_where_its_ceiling_was_measured() -> None:
    here, there = {"cpu": "AMD EPYC", "cores": 2, "isa": "AVX-512 with BF16"}, {"cpu": "AMD EPYC", "cores": 2,
                                                                                "isa": "AVX2"}
    result = {"settings": {"checkpoints": [15.0], "pool_size": 8, "eval_size": 4}, "ceiling_greedy": 0.9,
              "ceiling_file": "ceiling_bf16.json", "ceiling_machine": here, "machine": here,
              "runs": {"baseline": {"before": {"greedy": 0.0, "sampled": 0.0},
                                    "checkpoints": [{"minutes": 15.0, "steps": 3, "greedy": 0.5, "sampled": 0.5}]}}}
    rendered = tables.plateau("plateau_test.json")(result)
    assert "| -40.0 points |" in rendered
    assert "The SFT ceiling (`bench/results/ceiling_bf16.json`, the same kind of machine): 90.0% held-out greedy." in rendered
    elsewhere = tables.plateau("plateau_test.json")({**result, "ceiling_file": "ceiling.json", "ceiling_machine": there})
    assert "(`bench/results/ceiling.json`, measured on AMD EPYC, 2 cores, AVX2): 90.0%" in elsewhere
    assert "model" not in rendered.splitlines()[0]  # the embedded default
    larger = tables.plateau("plateau_test.json")({**result, "settings": {**result["settings"], "model": "/m/qwen"}})
    assert larger.startswith("`bench/results/plateau_test.json`, model `/m/qwen`, 8 training problems")


def test_each_round_of_a_plateau_run_is_read_against_its_own_baseline() -> None:
    def run(greedy: float) -> dict[str, object]:
        return {"before": {"greedy": 0.0, "sampled": 0.0},
                "checkpoints": [{"minutes": 15.0, "steps": 3, "greedy": greedy, "sampled": greedy}]}

    result = {"settings": {"checkpoints": [15.0], "pool_size": 8, "eval_size": 100}, "ceiling_greedy": None,
              "machine": {"cpu": "AMD EPYC", "cores": 2, "isa": "AVX2"},
              "runs": {"baseline": run(0.5), "clip_higher": run(0.6), "baseline-2": run(0.7), "clip_higher-2": run(0.6)}}
    rows = {line.split(" | ")[0]: line for line in tables.plateau("p.json")(result).splitlines() if line.startswith("| `")}
    assert rows["| `clip_higher`"].split(" | ")[-1].startswith("+10.0 ± ")
    assert rows["| `clip_higher-2`"].split(" | ")[-1].startswith("-10.0 ± ")
    assert rows["| `baseline-2`"].endswith(" |  |")


def test_the_temperature_gap_sets_rl_checkpoints_against_sft_passes_of_the_same_accuracy() -> None:
    machine = {"cpu": "AMD EPYC", "cores": 2, "isa": "AVX2"}
    rl = [{"machine": machine, "runs": {
        "baseline": {"checkpoints": [{"greedy": 0.72, "sampled": 0.71}, {"greedy": 0.85, "sampled": 0.84}]},
        "other": {"checkpoints": [{"greedy": 0.78, "sampled": 0.75}]}}}]
    sft = [{"machine": machine, "passes": [{"greedy": 0.75, "sampled": 0.70}, {"greedy": 1.0, "sampled": 0.96}]}]
    rendered = tables.temperature_gap(rl, sft)
    assert rendered.startswith("Every checkpoint of `bench/results/plateau*.json` (1 files, 3 checkpoints of 2 runs)")
    rows = [line for line in rendered.splitlines() if line.startswith("| ") and "%–" in line]
    assert rows == ["| 60%–70% | — | — |",
                    "| 70%–80% | -2.0 (-3.0 to -1.0, 2) | -5.0 (-5.0 to -5.0, 1) |",
                    "| 80%–90% | -1.0 (-1.0 to -1.0, 1) | — |",
                    "| 90%–100% | — | -4.0 (-4.0 to -4.0, 1) |"]


def test_the_whole_tasks_greedy_accuracy_joins_the_tables_of_runs_that_measured_it() -> None:
    machine = {"cpu": "AMD EPYC", "cores": 2, "isa": "AVX2"}

    def point(greedy: float, task: float, **more: object) -> dict[str, object]:
        return {"greedy": greedy, "sampled": greedy, "greedy_task": task, **more}

    def run(task: float) -> dict[str, object]:
        return {"before": point(0.1, 0.12), "checkpoints": [point(0.8, task, minutes=30.0, steps=9)]}

    result = {"settings": {"checkpoints": [30.0], "pool_size": 8, "eval_size": 100}, "ceiling_greedy": 0.9,
              "ceiling_greedy_task": 0.93, "ceiling_file": "ceiling.json", "ceiling_machine": machine,
              "machine": machine, "runs": {"baseline": run(0.81), "entropy_control": run(0.85)}}
    rendered = tables.plateau("p.json")(result)
    assert "| last: greedy on unseen problems | last: greedy over the whole task | steps |" in rendered
    rows = {line.split(" | ")[0]: line.split(" | ") for line in rendered.splitlines() if line[:3] == "| `"}
    assert rows["| `baseline`"][4] == "81.0%" and rows["| `entropy_control`"][4] == "85.0% (+4.0 points)"
    assert rendered.endswith("90.0% held-out greedy, 93.0% over the whole task.")
    older = {**result, "runs": {"baseline": {"before": point(0.1, 0.1), "checkpoints": [
        {"minutes": 30.0, "steps": 9, "greedy": 0.8, "sampled": 0.8}]}}, "ceiling_greedy_task": None}
    assert "whole task" not in tables.plateau("p.json")(older)  # a run that did not measure it

    ceiling = {"settings": {"pool_size": 8, "eval_size": 100, "batch_size": 4, "learning_rate": 2e-4},
               "machine": machine, "before": point(0.1, 0.12), "ceiling_greedy": 0.9,
               "ceiling_greedy_task": 0.93,
               "passes": [point(0.9, 0.93, **{"pass": 1, "steps": 2, "train_seconds": 10.0, "loss": 0.5})]}
    rendered = tables.ceiling("c.json")(ceiling)
    assert "| 1 | 2 | 10 | 0.5000 | 90.0% | 90.0% | — | 93.0% |" in rendered
    assert rendered.endswith("from 10.0% before training; over the whole task, **93.0%**, from 12.0%.")
