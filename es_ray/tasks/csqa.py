"""CommonsenseQA (tau/commonsense_qa, split validation: the test split has no labels): 1,221 five-way questions.

Rows have ``question``, ``choices`` ({"label": [A..E], "text": [...]}) and ``answerKey``; a row without a valid
``answerKey`` is skipped and counted. Graded by the letter after "Answer:".
"""

from __future__ import annotations

from es_ray.tasks.base import Problem
from es_ray.tasks.dataset import ChoiceTask, RowError, choice_question, list_field, text_field


class CSQATask(ChoiceTask):
    name = "csqa"
    hub_id, eval_split = "tau/commonsense_qa", "validation"

    def parse(self, row: dict) -> Problem:
        question = text_field(row, "question")
        choices = row["choices"]
        if not isinstance(choices, dict):
            raise RowError("choices is not an object with label and text")
        labels = [str(x).strip().upper() for x in list_field(choices.get("label"), "choices.label")]
        texts = [str(x) for x in list_field(choices.get("text"), "choices.text")]
        letters = "".join(labels)
        if len(labels) != len(texts) or len(labels) < 2 or any(len(x) != 1 for x in labels):
            raise RowError("choices malformed")
        answer = str(row.get("answerKey") or "").strip().upper()
        if answer not in labels:
            raise RowError("answerKey missing or not among the labels")
        return Problem(
            question=choice_question(question, texts, letters),
            answer=answer,
            meta={"letters": letters, "id": row.get("id")},
        )
