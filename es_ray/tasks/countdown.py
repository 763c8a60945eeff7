"""Countdown: reach a target with +, -, *, / using each given number exactly once.

Problems are generated from ``task.seed`` (solvable by construction), or read from ``task.path`` in the
schema of Jiayi-Pan/Countdown-Tasks-3to4 (``target``, ``nums``). The reward parses the equation in
<answer>...</answer> (never eval): 1 if it is right and uses every number once, 0.1 if well formed, else 0.
"""

from __future__ import annotations

import random
from fractions import Fraction

from es_ray.grading.countdown import score
from es_ray.tasks.base import Problem, Task, read_rows

PROMPT = (
    "Using the numbers {nums}, create an equation that equals {target}. You can use +, -, * and /, and each "
    "number exactly once. Show your work briefly, then give the equation in <answer></answer> tags, "
    "for example <answer>(1 + 2) / 3</answer>."
)


def _make(nums: list[int], target: int) -> Problem:
    return Problem(question=PROMPT.format(nums=nums, target=target), answer=int(target), meta={"nums": list(nums)})


class CountdownTask(Task):
    name = "countdown"

    def _generate(self, rng: random.Random) -> Problem:
        k = self.cfg.countdown_numbers
        while True:
            nums = [rng.randint(1, 99) for _ in range(k)]
            order = nums[:]
            rng.shuffle(order)
            value = Fraction(order[0])
            for x in order[1:]:
                op = rng.choice("+-*/")
                value = {"+": value + x, "-": value - x, "*": value * x, "/": value / x}[op]
            if value.denominator == 1 and 1 <= value <= 1000:
                return _make(nums, int(value))

    def load(self):
        want = self.cfg.train_size + self.cfg.eval_size
        if self.cfg.path:
            problems = []
            for row in read_rows(self.cfg.path):
                try:
                    nums = [int(x) for x in row["nums"]]
                    problems.append(_make(nums, int(row["target"])))
                except (KeyError, TypeError, ValueError):
                    self.skipped_rows += 1
        else:
            rng = random.Random(self.cfg.seed)
            problems = [self._generate(rng) for _ in range(want)]
        self._file_problems = problems if self.cfg.path else None
        return problems[: self.cfg.train_size], problems[self.cfg.train_size : want]

    def eval_problems(self) -> list[Problem]:
        """es-eval: every problem of ``task.path`` in file order, else the generated held-out set."""
        return list(self._file_problems) if self._file_problems is not None else list(self.eval)

    def reward(self, completion: str, problem: Problem) -> float:
        return score(completion, problem.meta["nums"], problem.answer)
