"""Shared loading for dataset tasks: hub id or ``task.path`` (a local file in the hub schema), rows parsed one by
one (a malformed row is skipped and counted in ``skipped_rows``; an error of any other type is a bug in the parser
and propagates), and the split into a training pool and a held-out set. Also the two grader families most tasks
share: math answers (math-verify) and multiple choice.

Training sets (``train_split`` set, e.g. GSM8K): from the hub, the training pool is ``train_split`` and the
held-out set the first ``task.eval_size`` problems of ``test_split`` (0: all of it); from one file (or another
split, or a dataset with no test split) a fixed shuffle (``task.seed``) splits it. es-eval scores the whole test
split (or the whole file).

Benchmarks (``train_split = None``, e.g. MATH-500): one split, ``eval_split``, read in order (``task.split`` is
used instead when set to something other than its default "train"). The held-out set is the first
``task.eval_size`` problems (0: all); the training pool is the rest, or the same problems when none are left (a
benchmark used as ES fitness then trains on what it is scored on: do that knowingly). es-eval scores them all.
"""

from __future__ import annotations

import random
import re

from es_ray.grading.boxed import last_boxed, restates_problem
from es_ray.grading.choice import extract_letter
from es_ray.grading.mathverify import check_one, default_pool
from es_ray.grading.result import Grade
from es_ray.core.config import TaskConfig
from es_ray.tasks.user_reward import ROW_KEY
from es_ray.tasks.base import LINE_KEY, Problem, SkippedRows, Task, TaskLoadError, hub_rows, read_rows

MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
MAX_QUESTION_CHARS = 20_000
"""A problem whose prompt is longer is skipped and counted at load (the longest prompt of the paper's benchmarks is
under 5,000 characters): a 10 MB question never reaches an engine as a 10 MB prompt."""
_MALFORMED = (KeyError, ValueError, RecursionError)
"""What a malformed row raises (RowError is a ValueError): a missing key, a value of the wrong type or that does
not parse. Not TypeError or AttributeError: those come from a bug in the parser, which must not read as bad data."""


class RowError(ValueError):
    """A row that does not fit the task's schema (skipped and counted)."""


def parse_rows(
    rows: list, parse, skipped: SkippedRows | None = None, keep_rows: bool = False
) -> tuple[list[Problem], int]:
    """``parse`` over each row: (the problems, how many rows were malformed and skipped); ``skipped`` also counts
    them per reason (``skip_reason``) and notes where the first one is; ``keep_rows``: each problem keeps its row
    (``meta["row"]``, the columns task.reward's function is given; kept only then: a large file's rows cost memory
    in every actor)."""
    out, count = [], 0
    for i, row in enumerate(rows):
        where = f"line {row[LINE_KEY]}" if isinstance(row, dict) and LINE_KEY in row else f"row {i + 1}"
        try:
            if isinstance(row, dict) and "__malformed__" in row:
                raise RowError("not JSON")
            if not isinstance(row, dict):
                raise RowError("not a JSON object")
            row = {k: v for k, v in row.items() if k != LINE_KEY}
            problem = parse(row)
            if keep_rows:
                problem.meta.setdefault(ROW_KEY, row)
            if len(problem.question) > MAX_QUESTION_CHARS:
                raise RowError(f"question longer than {MAX_QUESTION_CHARS} characters")
            out.append(problem)
        except _MALFORMED as exc:
            count += 1
            if skipped is not None:
                skipped.add(skip_reason(exc), where)
    if skipped is not None:
        skipped.read += len(rows)
    return out, count


def skip_reason(exc: Exception) -> str:
    """A skipped row's reason in a few words: ``missing "answer"`` for a missing key, else the error's text."""
    if isinstance(exc, KeyError):
        return f'missing "{exc.args[0]}"' if exc.args else "a missing field"
    if isinstance(exc, RecursionError):
        return "nested too deep"
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text if len(text) <= 80 else text[:77] + "..."


def text_field(row: dict, *keys: str) -> str:
    """The first of ``keys`` present in ``row`` as a non-empty string; RowError when none is."""
    for key in keys:
        value = row.get(key)
        if isinstance(value, (dict, list, tuple, bool, bytes)):  # str() of these is text no one wrote
            raise RowError(f"{key} is a {type(value).__name__}, not text")
        if value is not None and str(value).strip():
            return str(value).strip()
    raise RowError("missing " + " or ".join(f'"{k}"' for k in keys))


def list_field(value, what: str) -> list:
    """A list column (a list, or the array a Parquet file gives) as a list; RowError for anything else."""
    if value is None or isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        raise RowError(f"{what} is not a list")
    return list(value)


def answer_text(value) -> str:
    """A reference answer as text: 27.0 -> "27" (float columns), strings stripped; RowError when empty."""
    if isinstance(value, bool) or value is None:
        raise RowError("no answer")
    if isinstance(value, float):
        if value != value:  # NaN: an empty cell from a CSV/Parquet file
            raise RowError("no answer")
        return str(int(value)) if value.is_integer() else repr(value)
    text = str(value).strip()
    if not text:
        raise RowError("empty answer")
    return text


class DatasetTask(Task):
    hub_id: str = ""
    hub_configs: tuple[str | None, ...] = (None,)
    """Hub configs whose rows are concatenated (AIME 2025 has two, one per exam)."""
    train_split: str | None = None
    """None: a benchmark (evaluation set)."""
    test_split: str | None = "test"
    """Train sets: the held-out split (None: the training split is split by a fixed shuffle)."""
    eval_split: str = "test"
    """Benchmarks: the split that holds the benchmark."""

    def parse(self, row: dict) -> Problem:
        """One row -> Problem; raise RowError (or KeyError/ValueError) for a malformed row, nothing else."""
        raise NotImplementedError

    def rows(self, split: str) -> list[dict]:
        if self.cfg.path:
            return read_rows(self.cfg.path)
        out: list[dict] = []
        for config in self.hub_configs:
            out.extend(hub_rows(self.hub_id, config, split, self.name))
        return out

    def problems(self, rows: list[dict], split: str | None = None) -> list[Problem]:
        """The parsed rows of ``split`` (of the hub, or task.path's file), the skipped ones counted per reason."""
        source = f"task.path={self.cfg.path}" if self.cfg.path else f"{self.hub_id} split {split}"
        skipped = SkippedRows(source)
        out, count = parse_rows(rows, self.parse, skipped, keep_rows=bool(getattr(self.cfg, "reward", "")))
        self.skipped_rows += count
        self.skipped.append(skipped)
        return out

    def load(self):
        cfg = self.cfg
        if self.train_split is None:
            split = cfg.split if cfg.split != "train" else self.eval_split
            self._all = self.problems(self.rows(split), split)
            held = self._all[: cfg.eval_size] if cfg.eval_size else list(self._all)
            train = self._all[len(held) :] or list(held)
            self.check_split(len(self._all), len(held), len(train))
        elif cfg.path or cfg.split != self.train_split or self.test_split is None:
            pool = self.problems(self.rows(cfg.split), cfg.split)
            self._all = list(pool)
            random.Random(cfg.seed).shuffle(pool)  # one file or split: a fixed shuffle splits it
            held, train = pool[: cfg.eval_size], pool[cfg.eval_size :]
            self.check_split(len(pool), len(held), len(train))
        else:
            train = self.problems(self.rows(self.train_split), self.train_split)
            self._all = self.problems(self.rows(self.test_split), self.test_split)
            held = self._all[: cfg.eval_size] if cfg.eval_size else list(self._all)  # 0: the whole test split
        if cfg.train_size:
            train = train[: cfg.train_size]
        return train, held

    def check_split(self, usable: int, held: int, train: int) -> None:
        """A file of the user's whose training pool the default task.eval_size would leave smaller than the held-out
        set (40 rows: 32 held out, 8 to train) is refused with the numbers; a task.eval_size the user set is theirs."""
        if self.cfg.path and usable and self.cfg.eval_size == TaskConfig.eval_size and train < held:
            raise TaskLoadError(
                f"task.path={self.cfg.path} has {usable} usable rows, and the default task.eval_size="
                f"{self.cfg.eval_size} holds out {held} of them and leaves {train} to train: set "
                f"task.eval_size= to fewer (e.g. task.eval_size={max(1, usable // 5)}), "
                + (
                    "or 0 to score every row"
                    if self.train_split is None
                    else "or 0 for no held-out set (es-eval scores every row either way)"
                )
            )

    def eval_problems(self) -> list[Problem]:
        return list(self._all)


class MathTask(DatasetTask):
    """Free-form math: the prompt asks for \\boxed{}; math-verify (in its worker pool) decides equivalence."""

    majority_vote = True
    grade_timeout_s = None  # math-verify's worker pool holds its own per-check timeout

    question_keys: tuple[str, ...] = ("problem",)
    answer_keys: tuple[str, ...] = ("answer",)

    def parse(self, row: dict) -> Problem:
        question = text_field(row, *self.question_keys)
        if not any(k in row for k in self.answer_keys):
            raise RowError("missing " + " or ".join(f'"{k}"' for k in self.answer_keys))
        value = next(row[k] for k in self.answer_keys if k in row)
        return Problem(
            question=f"{question}\n\n{MATH_INSTRUCTION}",
            answer=answer_text(value),
            meta={"id": row.get("id", row.get("unique_id"))},
        )

    def reward(self, completion: str, problem: Problem) -> float:
        pred = self.prediction(completion)
        return 0.0 if pred is None else check_one(problem.answer, pred).score

    def grade(self, completion: str, problem: Problem) -> Grade:
        return self.grade_batch([completion], [problem])[0]

    def grade_batch(self, completions: list[str], problems: list[Problem]) -> list[Grade]:
        preds = [self.prediction(c) for c in completions]
        asked = [i for i, p in enumerate(preds) if p is not None]
        checked = default_pool().check([(problems[i].answer, preds[i]) for i in asked]) if asked else []
        grades = [Grade(0.0, False) for _ in completions]  # no final boxed answer: wrong, not a grader failure
        for i, g in zip(asked, checked):
            grades[i] = g
        return grades

    def prediction(self, completion: str) -> str | None:
        """What math-verify is given: the final box alone when there is one; without a box, nothing
        (task.answer=boxed) or the whole completion, whose last expression math-verify takes (last). So ``last``
        accepts every completion ``boxed`` accepts, and more."""
        box = last_boxed(completion)
        if box is not None:
            return f"\\boxed{{{box}}}"
        return completion if self.cfg.answer == "last" else None

    def answer_checks(self, completion: str, problem: Problem) -> dict[str, bool]:
        """Whether the completion has a final boxed answer, and whether its answer (the box, else the last $...$
        expression or line) only restates an expression of the problem."""
        box = last_boxed(completion)
        answer = box if box is not None else _last_expression(completion)
        return {"boxed": box is not None, "restated": restates_problem(answer, problem.question)}


_TOKEN = re.compile(r"\\[A-Za-z]+|[A-Za-z]+|\s+|.", re.S)


def _last_expression(text: str) -> str | None:
    """The last $...$ span; else the math at the end of the last line: its longest tail of LaTeX commands,
    numbers, symbols and one-letter names ("The sum is \\frac{1}{2}+\\frac{1}{3}" -> "\\frac{1}{2}+\\frac{1}{3}"),
    or the whole line when it has none."""
    spans = re.findall(r"\$([^$]+)\$", text)
    if spans:
        return spans[-1]
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return None
    line = lines[-1].rstrip(".")
    tokens = _TOKEN.findall(line)
    k = len(tokens)
    while k and (tokens[k - 1].startswith("\\") or len(tokens[k - 1]) == 1 or not tokens[k - 1].isalpha()):
        k -= 1
    tail = "".join(tokens[k:]).strip()
    return tail if any(not t.isspace() for t in tokens[k:]) and tail else line


def choice_question(question: str, options: list[str], letters: str) -> str:
    lines = [question.strip(), ""] + [f"{letter}) {text.strip()}" for letter, text in zip(letters, options)]
    fmt = ", ".join(letters)
    lines += ["", f"Think it through briefly, then end with a line of the form 'Answer: X', where X is one of {fmt}."]
    return "\n".join(lines)


class ChoiceTask(DatasetTask):
    """Multiple choice: the answer is a letter; ``problem.meta['letters']`` holds the valid ones."""

    majority_vote = True

    def reward(self, completion: str, problem: Problem) -> float:
        return 1.0 if extract_letter(completion, problem.meta["letters"]) == problem.answer else 0.0

    def answer_key(self, completion: str, problem: Problem) -> str | None:
        return extract_letter(completion, problem.meta["letters"])
