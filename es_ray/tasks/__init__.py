"""Tasks, one file each (loading, prompt, reward). ``load_task(cfg)`` builds one by ``task.name``."""

from __future__ import annotations

import importlib

from es_ray.core.config import TaskConfig
from es_ray.core.registry import Registry
from es_ray.tasks.base import TaskLoadError

TASKS = Registry("task.name", {
    "arithmetic": "es_ray.tasks.arithmetic:ArithmeticTask",
    "countdown": "es_ray.tasks.countdown:CountdownTask",
    "gsm8k": "es_ray.tasks.gsm8k:GSM8KTask",
    "deepscaler": "es_ray.tasks.deepscaler:DeepScaleRTask",
    "math500": "es_ray.tasks.math500:Math500Task",
    "aime24": "es_ray.tasks.aime24:AIME24Task",
    "aime25": "es_ray.tasks.aime25:AIME25Task",
    "amc23": "es_ray.tasks.amc23:AMC23Task",
    "gpqa": "es_ray.tasks.gpqa:GPQATask",
    "csqa": "es_ray.tasks.csqa:CSQATask",
    "mbpp": "es_ray.tasks.mbpp:MBPPTask",
})
EVAL_TASKS = ("gpqa", "mbpp", "csqa", "countdown", "aime24", "aime25", "amc23", "math500")
"""The paper's evaluation suite (es-eval's default eval.tasks)."""


def task_class(name: str):
    """A built-in task by name, or a user task given as an import path ``package.module:ClassName``."""
    if name in TASKS:
        try:
            return TASKS.get(name)
        except (ImportError, AttributeError) as exc:
            raise TaskLoadError(f"task.name={name!r}: cannot import its class ({exc})") from exc
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
