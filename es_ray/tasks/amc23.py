"""AMC 2023 (math-ai/amc23, split test): 40 problems; rows have ``id``, ``question`` and ``answer`` (a number,
stored as a float: 27.0 is read as 27), and ``url``. Graded with math-verify."""

from __future__ import annotations

from es_ray.tasks.dataset import MathTask


class AMC23Task(MathTask):
    name = "amc23"
    hub_id, eval_split = "math-ai/amc23", "test"
    question_keys = ("question", "problem")
