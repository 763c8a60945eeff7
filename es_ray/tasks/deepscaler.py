"""DeepScaleR (agentica-org/DeepScaleR-Preview-Dataset): ~40k competition math problems, a training set.

Rows have ``problem``, ``answer`` (LaTeX) and ``solution``; the reward is 1 when math-verify finds the boxed
answer equivalent to ``answer``. The hub has only a train split: a fixed shuffle (``task.seed``) holds out
``task.eval_size`` problems. ``task.path`` reads a local file in the same schema.
"""

from __future__ import annotations

from es_ray.tasks.dataset import MathTask


class DeepScaleRTask(MathTask):
    name = "deepscaler"
    hub_id = "agentica-org/DeepScaleR-Preview-Dataset"
    train_split, test_split = "train", None
