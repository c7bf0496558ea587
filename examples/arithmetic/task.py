"""A small verifiable task: two-term integer arithmetic, the answer inside <answer></answer> tags.

The 135M default model needs one worked example turn in the prompt to use the tags at all (with a
system instruction alone it does not). The reward is checkable by code: 1 for the right number
in the tags, a small credit for using the format with a wrong number, 0 for anything unparseable.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

SYSTEM_PROMPT = "You are a calculator. Give the result inside <answer></answer> tags."
WORKED_EXAMPLE = [
    {"role": "user", "content": "What is 12 + 7?"},
    {"role": "assistant", "content": "<answer>19</answer>"},
]
FORMAT_CREDIT = 0.1
# The demo's draws. Operands 0-20 make 672 distinct problems, so a held-out draw repeats many training
# problems: bench/tables.py reports the held-out problems the training pool lacks on their own.
TRAINING_SEED = 0
HELD_OUT_SEED = 10_000
_ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")


@dataclass(frozen=True)
class Problem:
    a: int
    b: int
    op: str

    @property
    def question(self) -> str:
        return f"What is {self.a} {self.op} {self.b}?"

    @property
    def answer(self) -> int:
        return self.a + self.b if self.op == "+" else self.a - self.b

    def messages(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": SYSTEM_PROMPT}, *WORKED_EXAMPLE,
                {"role": "user", "content": self.question}]

    def solved(self) -> list[dict[str, str]]:
        """The prompt and the right answer in the tags: a supervised example, or a guide's reference."""
        return [*self.messages(), {"role": "assistant", "content": f"<answer>{self.answer}</answer>"}]


def problems(seed: int, count: int, *, max_operand: int = 20) -> list[Problem]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        op = rng.choice("+-")
        if op == "-" and b > a:
            a, b = b, a  # keep results non-negative: easier for a 135M model
        out.append(Problem(a, b, op))
    return out


def every_problem(max_operand: int = 20) -> list[tuple[Problem, float]]:
    """Each distinct problem `problems` draws, with the chance that one draw is that problem: a policy's
    expected accuracy on the task is the sum of the chances of the problems it answers right.

    >>> task = every_problem()
    >>> len(task), round(sum(chance for _, chance in task), 12)
    (672, 1.0)
    >>> {problem.question: chance for problem, chance in every_problem(1) if problem.op == "-"}
    {'What is 0 - 0?': 0.125, 'What is 1 - 0?': 0.25, 'What is 1 - 1?': 0.125}
    """
    pairs = (max_operand + 1) ** 2
    operands = range(max_operand + 1)
    sums = [(Problem(a, b, "+"), 1 / (2 * pairs)) for a in operands for b in operands]
    # a difference with b > a is drawn with its operands swapped, so a > b is drawn both ways
    differences = [(Problem(a, b, "-"), (1 if a == b else 2) / (2 * pairs))
                   for a in operands for b in range(a + 1)]
    return sums + differences


def parse_answer(text: str) -> int | None:
    match = _ANSWER.search(text)
    return int(match.group(1)) if match else None


def reward(problem: Problem, text: str) -> tuple[float, dict[str, float]]:
    """Returns (reward, metrics). Unparseable output scores 0."""
    answer = parse_answer(text)
    correct = answer is not None and answer == problem.answer
    formatted = answer is not None
    value = 1.0 if correct else (FORMAT_CREDIT if formatted else 0.0)
    return value, {"correct": float(correct), "formatted": float(formatted)}
