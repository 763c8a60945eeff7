"""The task interface: a fixed training pool, a fixed held-out set, a prompt and a reward per problem."""

from __future__ import annotations

import json
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from es_ray.grading.limit import GRADE_TIMEOUT_S, time_limit
from es_ray.grading.result import Grade, GraderFailure
from es_ray.core.config import TaskConfig
from es_ray.tasks.errors import TaskLoadError  # noqa: F401 - raised here and imported from here by callers
from es_ray.tasks.user_reward import check_reward, import_reward, user_rewards

# pandas and datasets are imported where a file or the hub is read: a task built from JSON lines needs neither.


LINE_KEY = "__line__"
"""Where a row read from a JSONL file sits in it (1-based), for the skipped-rows line; parse_rows drops it."""


@dataclass
class SkippedRows:
    """The rows of one source (a file, a hub split) a task read, and the ones it skipped, per reason."""

    source: str
    read: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    first: str | None = None
    """Where the first skipped row is: "line 7" in a JSONL file, else "row 7"."""

    @property
    def count(self) -> int:
        return sum(self.reasons.values())

    def add(self, reason: str, where: str) -> None:
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        self.first = self.first or where

    def line(self) -> str:
        """``skipped 3 of 40 rows of <source>: 2 missing "answer", 1 not JSON; first at line 7``."""
        why = ", ".join(f"{n} {reason}" for reason, n in sorted(self.reasons.items(), key=lambda kv: -kv[1]))
        return f"skipped {self.count} of {self.read} rows of {self.source}: {why}; first at {self.first}"


def epoch_prompts(pool_size: int, per_step: int, step: int, seed: int) -> list[int]:
    """The training prompts of ``step`` when an epoch is a pass, for ES and GRPO alike: each epoch visits the whole
    pool once, in an order fixed by (seed, epoch); the steps take consecutive slices of ``per_step`` from the epochs
    laid end to end (a slice that crosses an epoch's end takes the next epoch's first prompts). Sorted indices; a
    prompt repeats within a step only when per_step exceeds the pool."""
    if pool_size < 1 or per_step < 1:
        raise ValueError(f"need a non-empty training pool and prompts per step, got {pool_size} and {per_step}")
    first, out = step * per_step, []
    epoch, pos = divmod(first, pool_size)
    while len(out) < per_step:
        order = list(range(pool_size))
        random.Random(f"{seed}/epoch/{epoch}").shuffle(order)
        take = order[pos : pos + per_step - len(out)]
        out += take
        epoch, pos = epoch + 1, 0
    return sorted(out)


@dataclass(frozen=True)
class Problem:
    question: str
    """The user message."""
    answer: Any
    """What the reward compares against (task specific)."""
    meta: dict = field(default_factory=dict, compare=False)


class Task(ABC):
    name: str = "task"
    system_prompt: str | None = None
    majority_vote: bool = False
    """Whether completions have a canonical answer to vote on (``answer_key``), i.e. whether maj@k is defined."""
    grade_timeout_s: float | None = GRADE_TIMEOUT_S
    """Time limit per completion's reward or grade (es_ray.grading.limit); None where the grader holds its own."""
    dense_reward: bool = False
    """Whether the reward grades closeness (partial credit), so the held-out reward moves before pass@1 does: the
    trainers' progress shows eval/reward for such a task, eval/pass_at_1 for a right-or-wrong one."""

    def __init__(self, cfg: TaskConfig):
        self.cfg = cfg
        self.skipped_rows = 0
        self.skipped: list[SkippedRows] = []
        """Per source read (a file, a hub split), its rows and the ones skipped per reason (``skipped_lines``)."""
        self.train, self.eval = self.load()
        if not self.train:
            every = [s for s in self.skipped if s.read and s.count == s.read]
            if every:
                raise TaskLoadError(
                    f"task {self.name}: every row was skipped, {every[0].line()}: the rows do not fit "
                    f"{self.name}'s schema; fix the file at task.path=, or set task.name= to the task "
                    "they fit"
                )
            raise TaskLoadError(f"task {self.name}: the training pool is empty; check task.path / task.train_size")
        self.user_reward = None
        """task.reward's callable (es_ray.tasks.user_reward), which ``score`` calls instead of ``reward``."""
        if getattr(cfg, "reward", ""):
            self.user_reward = import_reward(cfg.reward)
            check_reward(cfg.reward, self.user_reward, self.train[0])

    def skipped_lines(self) -> list[str]:
        """One line per source with skipped rows, for the drivers and es-eval to print."""
        return [f"task {self.name}: {s.line()}" for s in self.skipped if s.count]

    @abstractmethod
    def load(self) -> tuple[list[Problem], list[Problem]]:
        """(training pool, held-out set), both fixed for a given task config."""

    @abstractmethod
    def reward(self, completion: str, problem: Problem) -> float:
        """Scalar reward of one completion; may raise on malformed output (the caller scores that 0)."""

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        msgs = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return msgs + [{"role": "user", "content": problem.question}]

    # -- evaluation (es-eval) -------------------------------------------------------------------------------

    def eval_problems(self) -> list[Problem]:
        """The problems an evaluation scores (es-eval): the held-out set unless a task says otherwise."""
        return list(self.eval)

    def answer_checks(self, completion: str, problem: Problem) -> dict[str, bool]:
        """Format checks of a completion's answer that es-eval counts (math: boxed, restated); none by default."""
        return {}

    def answer_key(self, completion: str, problem: Problem) -> str | None:
        """The completion's final answer in canonical form, for maj@k; None when there is nothing to vote on."""
        return None

    def grade(self, completion: str, problem: Problem) -> Grade:
        """Score, correctness (score >= 1), failure kind and vote key; a grader that raises or runs past
        ``grade_timeout_s`` scores 0, counted."""
        try:
            with time_limit(self.grade_timeout_s):
                score = float(self.reward(completion, problem))
                key = self.answer_key(completion, problem)
        except GraderFailure as exc:
            return Grade(0.0, False, exc.kind)
        except Exception:
            return Grade(0.0, False, "error")
        return Grade(score, score >= 1.0, None, key)

    def grade_batch(self, completions: list[str], problems: list[Problem]) -> list[Grade]:
        """One Grade per (completion, problem); tasks whose graders run in subprocesses run them in parallel."""
        return [self.grade(c, p) for c, p in zip(completions, problems)]


def read_rows(path: str | Path) -> list[dict]:
    """Rows of a local JSONL / JSON / Parquet / CSV file in the hub schema."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise TaskLoadError(f"task.path={str(path)!r} does not exist; point it at a JSONL/JSON/Parquet file")
    suffix = p.suffix.lower()
    if suffix == ".jsonl":  # a bad line (not JSON, not UTF-8, nested too deep) is one malformed row, not the file
        rows = []
        data = p.read_bytes()
        data = data[3:] if data.startswith(b"\xef\xbb\xbf") else data  # a Windows editor's byte-order mark
        for i, line in enumerate(data.splitlines()):
            if not line.strip():
                continue
            try:
                row = json.loads(line.decode("utf-8"))
                rows.append({**row, LINE_KEY: i + 1} if isinstance(row, dict) else row)
            except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                rows.append({"__malformed__": i + 1, LINE_KEY: i + 1})
        return rows
    if suffix == ".json":
        try:
            data = json.loads(p.read_text(encoding="utf-8-sig"))  # -sig: a byte-order mark is dropped
        except ValueError as exc:
            raise TaskLoadError(
                f"task.path={path} is not JSON ({str(exc).splitlines()[0]}); fix the file, or write "
                "one row per line as .jsonl, where a bad line skips that row only"
            ) from None
        rows = (
            data if isinstance(data, list) else data.get("data", data.get("rows")) if isinstance(data, dict) else None
        )
        if not isinstance(rows, list):
            keys = ", ".join(map(str, data)) if isinstance(data, dict) else type(data).__name__
            raise TaskLoadError(
                f'task.path={path} holds no "data" or "rows" list (keys: {keys}); make it a list of '
                "rows, or an object with the rows under data"
            )
        return rows
    if suffix in (".parquet", ".csv"):
        import pandas as pd

        df = pd.read_parquet(p) if suffix == ".parquet" else pd.read_csv(p)
        return df.to_dict(orient="records")
    raise TaskLoadError(f"task.path={str(path)!r}: unsupported file type {suffix}; use .jsonl, .json, .parquet or .csv")


def hub_rows(hub_id: str, config: str | None, split: str, task: str) -> list[dict]:
    """Rows of a hub dataset through `datasets`; a failure says how to use a local file instead."""
    try:
        import datasets
    except ImportError as exc:
        raise TaskLoadError(
            f"task {task}: could not load {hub_id}"
            + (f" ({config})" if config else "")
            + f" split {split!r}: the datasets package is not installed: pip install 'es-ray[data]', "
            "or point task.path= at a local JSONL file in the same schema"
        ) from exc
    try:
        return list(datasets.load_dataset(hub_id, config, split=split))
    except Exception as exc:  # no network, gated, unknown split
        raise TaskLoadError(
            f"task {task}: could not load {hub_id}"
            + (f" ({config})" if config else "")
            + f" split {split!r}: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}. "
            f"Download it elsewhere and point task.path= at a local JSONL file in the same schema."
        ) from exc


def score(task: Task, completions: list[str], problems: list[Problem]) -> tuple[list[float], int]:
    """The task's reward of each completion, and how many rewards raised: such a completion scores 0 and is
    counted (every method reports the count as reward/errors or eval/errors), never dropped silently."""
    limit = getattr(task, "grade_timeout_s", GRADE_TIMEOUT_S)
    if getattr(task, "user_reward", None) is not None:  # task.reward: one call per batch, TRL's shape
        return user_rewards(task.user_reward, completions, problems, limit or GRADE_TIMEOUT_S)
    rewards, errors = [], 0
    for text, problem in zip(completions, problems):
        try:
            with time_limit(limit):
                rewards.append(float(task.reward(text, problem)))
        except Exception:  # a reward bug, an odd completion or one past the time limit: 0, counted
            rewards.append(0.0)
            errors += 1
    return rewards, errors


def templated_prompts(engine, task: Task) -> dict[str, list[str]]:
    """The task's training pool and held-out set as prompt texts in the engine's chat template, by split."""
    return {
        split: [engine.apply_chat_template(task.messages(p)) for p in problems]
        for split, problems in (("train", task.train), ("eval", task.eval))
    }
