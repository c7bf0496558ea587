"""The arithmetic demo's step table: a row lines up under its header and shows the plateau's two signs and the
guided and rescued groups; the guide's reference is the right answer, which the task's reward passes."""

from __future__ import annotations

import pytest

import artlike as art
from examples.arithmetic import demo


def step(**fields: object) -> art.PipelineStep:
    base: dict[str, object] = dict(index=3, from_step=2, step=3, trained=True, groups=4, trajectories=16,
                                   reward_mean=0.55, reward_std=0.4, metrics={"correct": 0.5, "formatted": 1.0},
                                   staleness_mean=0.0, staleness_max=0, groups_dropped_stale=0,
                                   groups_dropped_failed=0, zero_variance_groups=1, loss=0.0123,
                                   rollout_seconds=12.0, wait_seconds=0.0, train_seconds=20.5, step_seconds=33.0)
    return art.PipelineStep.model_validate({**base, **fields})


def test_a_row_shows_entropy_and_the_zero_variance_fraction_under_their_headers(
        capsys: pytest.CaptureFixture[str]) -> None:
    demo.print_header()
    demo._print_row(step(entropy=0.4321, zero_variance_fraction=0.25, groups_guided=2, groups_rescued=1))
    demo._print_row(step())  # not reported: a dash, the columns still line up
    header, first, second = capsys.readouterr().out.strip("\n").splitlines()
    columns = header.split()
    assert columns[5:9] == ["entropy", "zero-var", "guided", "rescued"]
    assert first.split()[5:9] == ["0.432", "25%", "2", "1"] and second.split()[5:9] == ["—", "—", "0", "0"]
    assert len(first) == len(second) == len(header)


def test_the_demos_reference_is_the_right_answer_with_its_full_reward() -> None:
    from examples.arithmetic.task import problems

    problem = problems(seed=5, count=1)[0]
    reference = demo.reference(problem)
    assert reference.reward == 1.0 and reference.messages()[:-1] == problem.messages()
    assert reference.messages()[-1] == {"role": "assistant", "content": f"<answer>{problem.answer}</answer>"}
