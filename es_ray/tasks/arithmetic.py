"""Generated arithmetic (the CPU demo's default): `a + b`-style problems of configurable difficulty.

A 135M model scores near zero on GSM8K and Countdown, so the demo needs a task where it starts above zero and can
improve. The reward is dense: 1 for the exact answer, otherwise up to 0.5 for closeness,
0.5 * max(0, 1 - |prediction - answer| / (|answer| + 10)), and 0 when no number is found.
"""

from __future__ import annotations

import random

from es_ray.grading.numbers import final_number
from es_ray.tasks.base import Problem, Task, TaskLoadError


class ArithmeticTask(Task):
    name = "arithmetic"
    dense_reward = True  # closeness earns up to 0.5: the held-out reward moves long before pass@1
    system_prompt = None  # the model's own default system prompt; the instruction is in the question

    def _problem(self, rng: random.Random) -> Problem:
        cfg = self.cfg
        lo, hi = (0 if cfg.digits == 1 else 10 ** (cfg.digits - 1)), 10**cfg.digits - 1
        operands = [rng.randint(lo, hi) for _ in range(max(2, cfg.num_operands))]
        ops = [rng.choice(cfg.operations) for _ in range(len(operands) - 1)]
        expr = str(operands[0])
        for op, x in zip(ops, operands[1:]):
            expr += f" {op} {x}"
        value = _evaluate(operands, ops)
        return Problem(question=f"What is {expr}? Reply with only the number.", answer=value, meta={"expression": expr})

    def load(self):
        if not self.cfg.operations or set(self.cfg.operations) - set("+-*"):
            raise TaskLoadError(f"task.operations={self.cfg.operations!r}: use a non-empty subset of '+-*'")
        if not 1 <= self.cfg.digits <= 9:
            raise TaskLoadError(f"task.digits={self.cfg.digits} must be between 1 and 9")
        rng = random.Random(self.cfg.seed)
        seen: set[str] = set()
        problems: list[Problem] = []
        want = self.cfg.train_size + self.cfg.eval_size
        attempts = 0
        while len(problems) < want and attempts < 50 * want:
            attempts += 1
            p = self._problem(rng)
            if p.question not in seen:  # the held-out set never repeats a training problem
                seen.add(p.question)
                problems.append(p)
        if len(problems) < want:
            raise TaskLoadError(
                f"task arithmetic: only {len(problems)} distinct problems found for digits={self.cfg.digits}, "
                f"operations={self.cfg.operations!r}; lower task.train_size + task.eval_size ({want}) "
                "or raise task.digits"
            )
        return problems[: self.cfg.train_size], problems[self.cfg.train_size :]

    def reward(self, completion: str, problem: Problem) -> float:
        pred = final_number(completion)
        if pred is None:
            return 0.0
        if pred == problem.answer:
            return 1.0
        return 0.5 * max(0.0, 1.0 - float(abs(pred - problem.answer)) / (abs(problem.answer) + 10))


def _evaluate(operands: list[int], ops: list[str]) -> int:
    # standard precedence: * before + and -
    terms, signs = [operands[0]], []
    for op, x in zip(ops, operands[1:]):
        if op == "*":
            terms[-1] *= x
        else:
            signs.append(op)
            terms.append(x)
    value = terms[0]
    for op, x in zip(signs, terms[1:]):
        value = value + x if op == "+" else value - x
    return value
