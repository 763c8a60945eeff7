"""AIME 2024 (HuggingFaceH4/aime_2024, split train): the 30 problems of AIME 2024 I and II; rows have ``id``,
``problem``, ``solution``, ``answer`` (an integer 0-999, as text), ``url``, ``year``. Graded with math-verify."""

from __future__ import annotations

from es_ray.tasks.dataset import MathTask


class AIME24Task(MathTask):
    name = "aime24"
    hub_id, eval_split = "HuggingFaceH4/aime_2024", "train"
