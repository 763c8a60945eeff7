"""GPQA Diamond (Idavidrein/gpqa, config gpqa_diamond, split train; gated: accept its terms on the hub and log
in, or use ``task.path``): 198 graduate-level multiple-choice questions.

Rows have ``Question``, ``Correct Answer`` and ``Incorrect Answer 1..3``. The four options are shuffled with a
fixed seed per question (``task.seed`` and the question text), so the letter of the right answer is the same in
every run and does not depend on row order. Graded by the letter after "Answer:".
"""

from __future__ import annotations

import random

from es_ray.tasks.base import Problem
from es_ray.tasks.dataset import ChoiceTask, RowError, choice_question, text_field

LETTERS = "ABCD"


class GPQATask(ChoiceTask):
    name = "gpqa"
    hub_id, hub_configs, eval_split = "Idavidrein/gpqa", ("gpqa_diamond",), "train"

    def parse(self, row: dict) -> Problem:
        question = text_field(row, "Question")
        correct = text_field(row, "Correct Answer")
        options = [correct] + [text_field(row, f"Incorrect Answer {i}") for i in (1, 2, 3)]
        if len(set(options)) != 4:
            raise RowError("options are not distinct: the right letter would be ambiguous")
        random.Random(f"gpqa/{self.cfg.seed}/{question}").shuffle(options)
        answer = LETTERS[options.index(correct)]
        return Problem(
            question=choice_question(question, options, LETTERS),
            answer=answer,
            meta={"letters": LETTERS, "id": row.get("Record ID")},
        )
