"""``task.reward=package.module:function``: a reward of one's own for any task, in TRL's ``reward_funcs`` shape.

    def my_reward(prompts: list[str], completions: list[str], **columns) -> list[float]

``prompts``: each completion's user message (the task's question); ``completions``: the generated texts;
``columns``: every column of the rows the problems came from, as one list per column in the same order (a dataset
task's file or hub row: ``answer=[...]``, ``question=[...]``; a generated task gives ``question`` and ``answer``).
A TRL reward function ``def f(completions, answer, **kwargs)`` works unchanged. It replaces the task's reward in
training (ES fitness, GRPO rewards); the held-out pass@k stays the task's own grader, so a run's score is
comparable with any other run on that task (docs/tasks.md).

It runs in the actor, under the task's time limit per completion times the batch (es_ray.grading.limit): past it,
or when it raises or returns the wrong shape, the batch scores 0 and every completion counts as a reward error
(reward/errors), as a task's reward that raises does. A reward that executes model-written code must run it
through the project's sandbox (es_ray.grading.sandbox.run_python), as the mbpp task does: the actor process is not
a sandbox.
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

from es_ray.grading.limit import GRADE_TIMEOUT_S, time_limit
from es_ray.tasks.errors import TaskLoadError

RewardFn = Callable[..., Any]
ROW_KEY = "row"
"""``Problem.meta[ROW_KEY]``: the row a problem was parsed from (parse_rows sets it), for the columns."""


class RewardShapeError(ValueError):
    pass


def import_reward(spec: str) -> RewardFn:
    """The callable that ``task.reward=module:function`` names; TaskLoadError in one line when it cannot be."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise TaskLoadError(
            f"task.reward={spec!r} is not module:function; set task.reward=package.module:function "
            "(a callable over prompts, completions and the row's columns), or '' for the task's own"
        )
    if module.startswith("."):
        raise TaskLoadError(
            f"task.reward={spec!r}: a relative module; name it absolute (package.module:function), "
            "with its package on PYTHONPATH"
        )
    try:
        fn = getattr(importlib.import_module(module), name)
    except Exception as exc:  # noqa: BLE001 - not found, a SyntaxError, whatever the module raises at import
        first = str(exc).splitlines()[0] if str(exc) else ""
        top = module.split(".")[0]
        here = isinstance(exc, ModuleNotFoundError) and (Path(f"{top}.py").is_file() or Path(top).is_dir())
        where = (
            "it is in the current directory, which an installed command does not search: run with PYTHONPATH=$PWD"
            if here
            else "put its module on PYTHONPATH"
        )
        raise TaskLoadError(
            f"task.reward={spec!r}: cannot import it ({type(exc).__name__}: {first}); {where} (on a "
            "cluster: the job's working_dir or py_modules) and check it imports"
        ) from None
    if not callable(fn):
        raise TaskLoadError(f"task.reward={spec!r} is a {type(fn).__name__}, not a function")
    return fn


def batch_columns(problems: list) -> dict[str, list]:
    """The problems' rows as one list per column (a column a row lacks is None there)."""
    rows = [p.meta.get(ROW_KEY) or {"question": p.question, "answer": p.answer} for p in problems]
    keys = list(dict.fromkeys(k for row in rows for k in row))
    return {k: [row.get(k) for row in rows] for k in keys if k not in ("prompts", "completions")}


def call_reward(fn: RewardFn, completions: list[str], problems: list) -> list[float]:
    """``fn`` over one batch -> one finite float per completion; RewardShapeError when it returns anything else."""
    out = fn(prompts=[p.question for p in problems], completions=list(completions), **batch_columns(problems))
    if inspect.iscoroutine(out):
        out.close()
        raise RewardShapeError("is an async function; give a plain one (def, not async def)")
    if isinstance(out, (str, bytes, Mapping)):  # iterable, but its characters or keys are no rewards
        raise RewardShapeError(f"returned {type(out).__name__}, not a list of floats")
    try:
        values = [float(v) for v in out]
    except (TypeError, ValueError) as exc:
        raise RewardShapeError(f"returned {type(out).__name__}, not a list of floats ({exc})") from None
    if len(values) != len(completions):
        raise RewardShapeError(f"returned {len(values)} values for {len(completions)} completions")
    if not all(math.isfinite(v) for v in values):
        raise RewardShapeError("returned a value that is not finite")
    return values


def check_reward(spec: str, fn: RewardFn, problem) -> None:
    """At load: one call on the first training problem with two empty completions, so a wrong signature or return
    shape is one line before training starts, not a run of zero rewards."""
    try:
        with time_limit(GRADE_TIMEOUT_S):
            call_reward(fn, ["", ""], [problem, problem])
    except Exception as exc:  # noqa: BLE001 - whatever the user's function raises is reported in one line
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise TaskLoadError(
            f"task.reward={spec!r} failed on the first training problem ({type(exc).__name__}: "
            f"{first}); it is called as f(prompts=[...], completions=[...], **columns) and must "
            "return one float per completion"
        ) from None


def user_rewards(
    fn: RewardFn, completions: list[str], problems: list, per_completion_s: float | None
) -> tuple[list[float], int]:
    """(rewards, errors) of one batch: the batch all 0 and all counted when ``fn`` fails."""
    try:
        with time_limit(per_completion_s * max(1, len(completions)) if per_completion_s else None):
            return call_reward(fn, completions, problems), 0
    except Exception:  # noqa: BLE001 - a reward bug or a timeout scores the batch 0, counted, as score() does
        return [0.0] * len(completions), len(completions)
