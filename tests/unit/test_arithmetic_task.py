import doctest
from collections import Counter

from examples.arithmetic import task
from examples.arithmetic.task import FORMAT_CREDIT, Problem, every_problem, parse_answer, problems, reward


def test_problems_are_seeded_and_non_negative() -> None:
    assert problems(1, 20) == problems(1, 20)
    assert problems(1, 20) != problems(2, 20)
    assert all(p.answer >= 0 for p in problems(3, 200))


def test_parse_answer() -> None:
    assert parse_answer("so <answer> 42 </answer>") == 42
    assert parse_answer("<answer>-3</answer>") == -3
    assert parse_answer("42") is None
    assert parse_answer("<answer>forty</answer>") is None


def test_reward_levels() -> None:
    problem = Problem(7, 5, "-")
    assert reward(problem, "<answer>2</answer>") == (1.0, {"correct": 1.0, "formatted": 1.0})
    assert reward(problem, "<answer>3</answer>") == (FORMAT_CREDIT, {"correct": 0.0, "formatted": 1.0})
    assert reward(problem, "2") == (0.0, {"correct": 0.0, "formatted": 0.0})


def test_every_problem_carries_the_chance_the_draw_gives_it() -> None:
    assert doctest.testmod(task, raise_on_error=True).attempted >= 2
    chances = dict(every_problem())
    draws = 300_000
    drawn = Counter(problems(seed=7, count=draws))
    assert set(drawn) == set(chances)
    # total variation distance between the draw's frequencies and the chances: sampling noise only
    assert sum(abs(drawn[p] / draws - chance) for p, chance in chances.items()) / 2 < 0.03
