"""Tasks, one file each (loading, prompt, reward). ``load_task(cfg)`` builds one by ``task.name``."""

from __future__ import annotations

import importlib

from es_ray.config import TaskConfig

TASKS = {
    "arithmetic": "es_ray.tasks.arithmetic:ArithmeticTask",
    "countdown": "es_ray.tasks.countdown:CountdownTask",
    "gsm8k": "es_ray.tasks.gsm8k:GSM8KTask",
}


def load_task(cfg: TaskConfig):
    if cfg.name not in TASKS:
        raise ValueError(f"unknown task.name={cfg.name!r}; known tasks: {', '.join(sorted(TASKS))}")
    module, cls = TASKS[cfg.name].split(":")
    return getattr(importlib.import_module(module), cls)(cfg)
