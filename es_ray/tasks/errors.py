"""The error a task raises when it cannot load (a missing file, an unreachable hub, rows that do not fit, a user
reward that does not import): the entry points print it in one line, exit 2 (es_ray.runtime.entry)."""


class TaskLoadError(ValueError):
    pass
