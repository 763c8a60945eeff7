"""MATH-500 (HuggingFaceH4/MATH-500, split test): 500 MATH problems; rows have ``problem``, ``solution``,
``answer`` (LaTeX), ``subject``, ``level``, ``unique_id``. Graded with math-verify on the boxed answer."""

from __future__ import annotations

from es_ray.tasks.dataset import MathTask


class Math500Task(MathTask):
    name = "math500"
    hub_id, eval_split = "HuggingFaceH4/MATH-500", "test"

    def parse(self, row):
        p = super().parse(row)
        p.meta.update(subject=row.get("subject"), level=row.get("level"))
        return p
