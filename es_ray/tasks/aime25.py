"""AIME 2025 (opencompass/AIME2025): configs AIME2025-I and AIME2025-II (15 problems each, split test),
concatenated in that order; rows have ``question`` and ``answer``. A local ``task.path`` holds both parts in one
file in the same schema. Graded with math-verify."""

from __future__ import annotations

from es_ray.tasks.dataset import MathTask


class AIME25Task(MathTask):
    name = "aime25"
    hub_id, eval_split = "opencompass/AIME2025", "test"
    hub_configs = ("AIME2025-I", "AIME2025-II")
    question_keys = ("question", "problem")
