"""bench/plateau.py's resumed run: the runs of an earlier result file are kept only where they compare."""

from __future__ import annotations

import doctest
import json
from argparse import Namespace
from pathlib import Path

import pytest

from bench import plateau
from bench.machine import machine

SETTINGS = {"model": None, "checkpoints": [15.0, 30.0], "schedule_steps": 40, "pool_size": 1024, "eval_size": 200,
            "max_steps_off_policy": 0, "configs": ["curriculum"], "output": "x.json"}


def earlier(path: Path, **changes: object) -> Path:
    settings = {**SETTINGS, "configs": ["baseline"], **changes}
    path.write_text(json.dumps({"settings": settings, "configs": {"baseline": {"pipeline": {}, "train": {}}},
                                "runs": {"baseline": {"before": {}, "checkpoints": []}}, "machine": machine()}))
    return path


def test_the_earlier_runs_are_kept_when_settings_and_machine_match(tmp_path: Path) -> None:
    kept = plateau.resumed(earlier(tmp_path / "run.json"), SETTINGS)
    assert list(kept["runs"]) == ["baseline"] and list(kept["configs"]) == ["baseline"]


def test_no_file_is_a_fresh_run(tmp_path: Path) -> None:
    assert plateau.resumed(tmp_path / "none.json", SETTINGS) == {"configs": {}, "runs": {}}


def test_other_settings_or_another_machine_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"with other \['checkpoints'\]"):
        plateau.resumed(earlier(tmp_path / "run.json", checkpoints=[15.0]), SETTINGS)
    path = earlier(tmp_path / "other.json")
    recorded = json.loads(path.read_text())
    recorded["machine"]["cores"] = 64
    path.write_text(json.dumps(recorded))
    with pytest.raises(SystemExit, match="on another machine"):
        plateau.resumed(path, SETTINGS)
    recorded["machine"] = {**machine(), "platform": "another kernel build", "python": "3.11.0"}
    path.write_text(json.dumps(recorded))
    assert list(plateau.resumed(path, SETTINGS)["runs"]) == ["baseline"]  # a host of the same kind


def test_schedules_span_the_baselines_steps_unless_told() -> None:
    baseline = {"baseline": {"checkpoints": [{"steps": 199}, {"steps": 432}]}}
    assert plateau.schedule_steps(Namespace(schedule_steps=None), baseline) == 432
    assert plateau.schedule_steps(Namespace(schedule_steps=60), baseline) == 60
    assert plateau.schedule_steps(Namespace(schedule_steps=None), {}) == 200
    schedule = next(r for r in plateau.remedies(432) if r.name == "temperature").pipeline["temperature"]
    assert schedule.steps == 432


def test_the_schedules_steps_matter_only_to_runs_with_a_schedule(tmp_path: Path) -> None:
    settings = {**SETTINGS, "schedule_steps": None}
    assert list(plateau.resumed(earlier(tmp_path / "run.json"), settings)["runs"]) == ["baseline"]
    path = earlier(tmp_path / "scheduled.json")
    recorded = json.loads(path.read_text())
    recorded["configs"]["baseline"]["pipeline"] = {"temperature": repr(plateau.art.Schedule(start=1.3, end=1.0, steps=40))}
    path.write_text(json.dumps(recorded))
    with pytest.raises(SystemExit, match=r"with other \['schedule_steps'\]"):
        plateau.resumed(path, settings)


def test_the_ceiling_is_the_one_measured_on_this_machine(tmp_path: Path) -> None:
    def measured(name: str, greedy: float, **machine_changes: object) -> None:
        (tmp_path / name).write_text(json.dumps({"ceiling_greedy": greedy, "machine": {**machine(), **machine_changes}}))

    assert plateau.ceiling(tmp_path) is None
    measured("ceiling.json", 0.875, isa="elsewhere")
    assert plateau.ceiling(tmp_path) == {"file": "ceiling.json", "greedy": 0.875, "greedy_task": None,
                                         "machine": {**machine(), "isa": "elsewhere"}}
    measured("ceiling_bf16.json", 0.955, platform="another kernel build")  # the same kind of machine
    assert plateau.ceiling(tmp_path) == {"file": "ceiling_bf16.json", "greedy": 0.955, "greedy_task": None,
                                         "machine": {**machine(), "platform": "another kernel build"}}
    # another model's ceiling, on this very machine, is read only by runs of that model (`--model`)
    qwen = {"ceiling_greedy": 0.99, "ceiling_greedy_task": 0.98, "machine": machine(),
            "settings": {"model": "/models/qwen"}}
    (tmp_path / "ceiling_qwen.json").write_text(json.dumps(qwen))
    assert plateau.ceiling(tmp_path)["file"] == "ceiling_bf16.json"  # type: ignore[index]
    assert plateau.ceiling(tmp_path, model="/models/qwen") == {"file": "ceiling_qwen.json", "greedy": 0.99,
                                                               "greedy_task": 0.98, "machine": machine()}
    assert plateau.ceiling(tmp_path, model="/models/other") is None


def test_another_model_is_another_run(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"with other \['model'\]"):
        plateau.resumed(earlier(tmp_path / "run.json"), {**SETTINGS, "model": "/models/qwen"})


def test_the_run_keys_worked_example() -> None:
    assert doctest.testmod(plateau, raise_on_error=True).attempted >= 1
    assert plateau.run_keys(["baseline"], 1) == ["baseline"]
    assert [plateau.config_of(key) for key in plateau.run_keys(["baseline", "curriculum"], 3)] == [
        "baseline", "curriculum"] * 3


def test_the_guidance_config_guides_with_the_worked_answer_the_tasks_reward_passes() -> None:
    from examples.arithmetic.task import problems

    [guidance] = [r for r in plateau.remedies(100) if r.name == "guidance"]
    problem = problems(seed=3, count=1)[0]
    reference = guidance.pipeline["guide"](problem)
    assert reference.reward == 1.0 and reference.metrics == {"correct": 1.0, "formatted": 1.0}
    assert reference.messages() == [*problem.messages(),
                                    {"role": "assistant", "content": f"<answer>{problem.answer}</answer>"}]
    # the combination leaves guidance out: it brings in the answers, which the other remedies do not
    assert "guide" not in next(r for r in plateau.remedies(100) if r.name == "combined").pipeline


def test_a_rollout_stopped_at_the_answer_keeps_what_the_reward_reads() -> None:
    from examples.arithmetic.task import problems, reward

    stopped = [r for r in plateau.remedies(100) if r.stop]
    assert [r.name for r in stopped] == ["entropy_control_answer"]
    problem = problems(seed=3, count=1)[0]
    answer = problem.solved()[-1]["content"]
    for stop in stopped[0].stop:
        # sampling ends with the stop string, which the rollout keeps in the text: the right answer still scores
        ended = answer[:answer.index(stop) + len(stop)]
        assert ended == answer and reward(problem, ended)[0] == 1.0
        assert reward(problem, ended.removesuffix(stop))[0] == 0.0  # the reason it is kept


def test_every_configs_training_options_are_ones_the_trainer_takes() -> None:
    from artlike.types import train_config

    for remedy in plateau.remedies(100):
        # a misspelt option would fail only when its run starts, after the runs before it
        config = train_config(**{"learning_rate": plateau.LEARNING_RATE, **remedy.train})
        assert {name: getattr(config, name) for name in remedy.train} == remedy.train, remedy.name
    [kl] = [r for r in plateau.remedies(100) if r.name == "kl_penalty"]
    assert train_config(**kl.train).kl_beta == 0.1 and train_config().kl_beta == 0.0  # on only where asked


def test_a_machine_described_the_same_but_of_another_speed_is_refused(tmp_path: Path) -> None:
    path = earlier(tmp_path / "run.json")
    recorded = json.loads(path.read_text())
    path.write_text(json.dumps({**recorded, "speed": 100.0}))
    assert list(plateau.resumed(path, SETTINGS, speed=90.0)["runs"]) == ["baseline"]  # within 15%
    with pytest.raises(SystemExit, match="another speed"):
        plateau.resumed(path, SETTINGS, speed=60.0)
    assert list(plateau.resumed(earlier(tmp_path / "old.json"), SETTINGS, speed=60.0)["runs"]) == ["baseline"]


def test_the_machine_modules_doctests() -> None:
    from bench import machine as machine_module

    assert doctest.testmod(machine_module, raise_on_error=True).attempted >= 1


def test_the_benches_serve_the_model_asked_for() -> None:
    from bench import arithmetic

    assert doctest.testmod(arithmetic, raise_on_error=True).attempted >= 2
