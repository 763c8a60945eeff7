"""Countdown: reach a target with +, -, *, / using each given number exactly once.

Problems are generated from ``task.seed`` (solvable by construction; the default), or loaded from the hub set
Jiayi-Pan/Countdown-Tasks-3to4 (``task.countdown_source=hub``, split ``task.split``, needs the ``data`` extra), or
read from ``task.path``, a local file in that set's schema (``target``, ``nums``), which overrides both. Hub and
file rows load like every dataset task's (es_ray.tasks.dataset: malformed rows skipped and counted) and split in
order: the first ``task.train_size`` problems train, the next ``task.eval_size`` are held out, and es-eval scores
all of them. The reward parses the equation in <answer>...</answer> (never eval): 1 if it is right and uses
every number once, 0.1 if well formed, else 0.
"""

from __future__ import annotations

import numbers
import random
from fractions import Fraction

from es_ray.grading.countdown import score
from es_ray.tasks.base import Problem, SkippedRows, Task, TaskLoadError, hub_rows, read_rows
from es_ray.core.registry import Registry
from es_ray.tasks.dataset import RowError, list_field, parse_rows

HUB_ID = "Jiayi-Pan/Countdown-Tasks-3to4"
SOURCES = Registry(
    "task.countdown_source",
    {"generated": "puzzles generated here, seeded (every one solvable)", "hub": "the paper's hub dataset"},
)
"""task.countdown_source values (task.path= overrides either)."""

PROMPT = (
    "Using the numbers {nums}, create an equation that equals {target}. You can use +, -, * and /, and each "
    "number exactly once. Show your work briefly, then give the equation in <answer></answer> tags, "
    "for example <answer>(1 + 2) / 3</answer>."
)


def _make(nums: list[int], target: int) -> Problem:
    return Problem(question=PROMPT.format(nums=nums, target=target), answer=int(target), meta={"nums": list(nums)})


def _integer(value, what: str) -> int:
    """An integral number (7, 7.0 from a float column, "7") as int; RowError for anything else."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        return int(value)
    raise RowError(f"{what}={value!r} is not an integer")


def parse(row: dict) -> Problem:
    """One row of the hub schema (``target``, ``nums``) -> Problem; RowError/KeyError when it does not fit."""
    nums = [_integer(x, "nums") for x in list_field(row["nums"], "nums")]
    if len(nums) < 2:
        raise RowError("fewer than two nums")
    return _make(nums, _integer(row["target"], "target"))


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
        cfg = self.cfg
        if cfg.countdown_source not in SOURCES:  # a TaskLoadError (what a task's load raises), in the registry's words
            try:
                SOURCES.check(cfg.countdown_source)
            except ValueError as err:
                raise TaskLoadError(str(err)) from None
        want = cfg.train_size + cfg.eval_size
        self._loaded = None
        if cfg.path or cfg.countdown_source == "hub":
            rows = read_rows(cfg.path) if cfg.path else hub_rows(HUB_ID, None, cfg.split, self.name)
            skipped = SkippedRows(f"task.path={cfg.path}" if cfg.path else f"{HUB_ID} split {cfg.split}")
            self._loaded, self.skipped_rows = parse_rows(rows, parse, skipped, keep_rows=bool(cfg.reward))
            self.skipped.append(skipped)
            problems = self._loaded
        else:
            rng = random.Random(cfg.seed)
            problems = [self._generate(rng) for _ in range(want)]
        return problems[: cfg.train_size], problems[cfg.train_size : want]

    def eval_problems(self) -> list[Problem]:
        """es-eval: every problem loaded (hub split or ``task.path``) in order, else the generated held-out set."""
        return list(self._loaded) if self._loaded is not None else list(self.eval)

    def reward(self, completion: str, problem: Problem) -> float:
        return score(completion, problem.meta["nums"], problem.answer)
