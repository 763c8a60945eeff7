"""Tasks, one file each (loading, prompt, reward). ``load_task(cfg)`` builds one by ``task.name``."""

from __future__ import annotations

import importlib

from es_ray.core.config import TaskConfig
from es_ray.core.registry import Registry
from es_ray.tasks.base import TaskLoadError
from es_ray.tasks.aime24 import AIME24Task
from es_ray.tasks.aime25 import AIME25Task
from es_ray.tasks.amc23 import AMC23Task
from es_ray.tasks.arithmetic import ArithmeticTask
from es_ray.tasks.countdown import CountdownTask
from es_ray.tasks.csqa import CSQATask
from es_ray.tasks.deepscaler import DeepScaleRTask
from es_ray.tasks.gpqa import GPQATask
from es_ray.tasks.gsm8k import GSM8KTask
from es_ray.tasks.math500 import Math500Task
from es_ray.tasks.mbpp import MBPPTask

TASKS = Registry("task.name", {
    "arithmetic": ArithmeticTask,
    "countdown": CountdownTask,
    "gsm8k": GSM8KTask,
    "deepscaler": DeepScaleRTask,
    "math500": Math500Task,
    "aime24": AIME24Task,
    "aime25": AIME25Task,
    "amc23": AMC23Task,
    "gpqa": GPQATask,
    "csqa": CSQATask,
    "mbpp": MBPPTask,
})
EVAL_TASKS = ("gpqa", "mbpp", "csqa", "countdown", "aime24", "aime25", "amc23", "math500")
"""The paper's evaluation suite (es-eval's default eval.tasks)."""


def task_class(name: str):
    """A built-in task by name, or a user task given as an import path ``package.module:ClassName``."""
    if name in TASKS:
        return TASKS.get(name)
    if ":" not in name:
        raise TaskLoadError(
            f"unknown task.name={name!r}; known tasks: {', '.join(sorted(TASKS))} "
            "(or an import path package.module:TaskClass)"
        )
    module, cls = name.split(":")
    try:
        return getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError) as exc:
        raise TaskLoadError(f"task.name={name!r}: cannot import {name} ({exc})") from exc


def load_task(cfg: TaskConfig):
    return task_class(cfg.name)(cfg)
