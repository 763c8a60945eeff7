"""GSM8K (openai/gsm8k, config main): grade-school word problems; reward 1 when the final number is right.

Rows have ``question`` and ``answer``; the reference answer is the number after ``####``. ``task.path`` reads a
local JSONL file in the same schema. Rows without a parsable reference are skipped and counted.
"""

from __future__ import annotations

import random

from es_ray.grading.numbers import final_number, parse_number
from es_ray.tasks.base import Problem, Task, hub_rows, read_rows

HUB_ID, HUB_CONFIG = "openai/gsm8k", "main"
INSTRUCTION = "Solve the problem step by step. End with the final answer as '#### <number>'."


class GSM8KTask(Task):
    name = "gsm8k"

    def _rows(self, split: str) -> list[dict]:
        if self.cfg.path:
            return read_rows(self.cfg.path)
        return hub_rows(HUB_ID, HUB_CONFIG, split, self.name)

    def _problems(self, rows: list[dict]) -> list[Problem]:
        out = []
        for row in rows:
            try:
                question, answer = str(row["question"]), str(row["answer"])
                ref = parse_number(answer.split("####")[-1]) if "####" in answer else None
            except (KeyError, TypeError):
                ref = None
            if ref is None:
                self.skipped_rows += 1
                continue
            out.append(Problem(question=f"{question}\n\n{INSTRUCTION}", answer=ref))
        return out

    def load(self):
        pool = self._problems(self._rows(self.cfg.split))
        if self.cfg.path or self.cfg.split != "train":
            # one file or split: a fixed shuffle splits it into the pool and the held-out set
            random.Random(self.cfg.seed).shuffle(pool)
            held = pool[: self.cfg.eval_size]
            train = pool[self.cfg.eval_size :]
        else:
            train = pool
            held = self._problems(self._rows("test"))[: self.cfg.eval_size]
        if self.cfg.train_size:
            train = train[: self.cfg.train_size]
        return train, held

    def reward(self, completion: str, problem: Problem) -> float:
        pred = final_number(completion)
        return 1.0 if pred is not None and pred == problem.answer else 0.0
