"""GSM8K (openai/gsm8k, config main): grade-school word problems; reward 1 when the final number is right.

Rows have ``question`` and ``answer``; the reference answer is the number after ``####`` (or an answer that is
just a number: ``42`` or ``"42"``). ``task.path`` reads a
local JSONL file in the same schema. Rows without a parsable reference are skipped and counted. From the hub the
training pool is the train split and the held-out set the start of the test split (which es-eval scores whole);
one file is split by a fixed shuffle (es-eval scores the whole file).
"""

from __future__ import annotations

from es_ray.grading.numbers import final_number, parse_number
from es_ray.tasks.base import Problem
from es_ray.tasks.dataset import DatasetTask, RowError, text_field

HUB_ID, HUB_CONFIG = "openai/gsm8k", "main"
INSTRUCTION = "Solve the problem step by step. End with the final answer as '#### <number>'."


class GSM8KTask(DatasetTask):
    name = "gsm8k"
    majority_vote = True
    hub_id, hub_configs = HUB_ID, (HUB_CONFIG,)
    train_split, test_split = "train", "test"

    def parse(self, row: dict) -> Problem:
        question, answer = text_field(row, "question"), text_field(row, "answer")
        ref = parse_number(answer.split("####")[-1] if "####" in answer else answer)  # "42" or 42: the number
        if ref is None:
            raise RowError("no '#### <number>' in the answer, nor a bare number")
        return Problem(question=f"{question}\n\n{INSTRUCTION}", answer=ref)

    def reward(self, completion: str, problem: Problem) -> float:
        pred = final_number(completion)
        return 1.0 if pred is not None and pred == problem.answer else 0.0

    def answer_key(self, completion: str, problem: Problem) -> str | None:
        pred = final_number(completion)
        return None if pred is None else str(pred)
