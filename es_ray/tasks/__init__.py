"""Tasks, one file each (loading, prompt, reward). ``load_task(cfg)`` builds one by ``task.name``."""

from __future__ import annotations

import importlib

from es_ray.core.config import TaskConfig
from es_ray.core.registry import Registry
from es_ray.tasks.base import Task, TaskLoadError
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

TASKS = Registry(
    "task.name",
    {
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
    },
)
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
    if not is_import_path(name):
        raise TaskLoadError(
            f"task.name={name!r} is not package.module:TaskClass; set task.name= to one of "
            f"{', '.join(sorted(TASKS))} or to package.module:TaskClass"
        )
    module, cls = name.split(":")
    try:
        found = getattr(importlib.import_module(module), cls)
    except Exception as exc:  # noqa: BLE001 - not found, a SyntaxError, whatever the module raises at import
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise TaskLoadError(f"task.name={name!r}: cannot import {name} ({type(exc).__name__}: {first})") from exc
    if not (isinstance(found, type) and issubclass(found, Task)):
        raise TaskLoadError(
            f"task.name={name!r} is a {type(found).__name__}, not a Task class: set task.name= to a "
            "subclass of es_ray.tasks.base.Task (docs/tasks.md)"
        )
    return found


def is_import_path(name: str) -> bool:
    """``package.module:Attr``: one colon, a name on each side."""
    return name.count(":") == 1 and all(name.split(":"))


def load_task(cfg: TaskConfig):
    return task_class(cfg.name)(cfg)
