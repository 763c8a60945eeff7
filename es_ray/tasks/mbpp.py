"""MBPP (google-research-datasets/mbpp, config full, split test: 500 problems), graded by running the tests.

Rows (full) have ``task_id``, ``text``, ``code``, ``test_list``, ``test_setup_code`` and ``challenge_test_list``;
the sanitized config's rows (``prompt``, ``test_imports``, ``test_list``) load from ``task.path`` too. The prompt
is the usual MBPP one (the task and its tests) and asks for one ```python block. The completion's code, the setup
code and the asserts of ``test_list`` run in the sandbox (es_ray.grading.sandbox): reward 1 when every assert
holds, checked outside the program's process. A row whose tests are not strings, each one assert statement, is
skipped and counted. ``challenge_test_list`` is not used.
"""

from __future__ import annotations

import ast

from es_ray.grading.code import SANDBOX_FAILURES, build_program, extract_code, grade_programs
from es_ray.grading.result import Grade, GraderFailure
from es_ray.grading.sandbox import SandboxLimits, SandboxUnavailable, require_sandbox, run_python
from es_ray.grading.verdict import task_functions
from es_ray.tasks.base import Problem, TaskLoadError
from es_ray.tasks.dataset import DatasetTask, RowError, list_field, text_field

PROMPT = (
    "You are an expert Python programmer, and here is your task: {text} Your code should pass these tests:"
    "\n\n{tests}\n\nWrite the complete solution in a single ```python code block."
)


def _is_one_assert(test: str) -> bool:
    try:
        body = ast.parse(test).body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return len(body) == 1 and isinstance(body[0], ast.Assert)


class MBPPTask(DatasetTask):
    name = "mbpp"
    hub_id, hub_configs, eval_split = "google-research-datasets/mbpp", ("full",), "test"
    sandbox_limits = SandboxLimits()
    """Limits for each program (es-eval sets eval.code_timeout_s / eval.code_memory_mb here)."""
    sandbox_workers = 2
    grade_timeout_s = None  # the sandbox's own wall clock limits each program

    def load(self):
        try:  # refuse to start where programs cannot be confined, rather than score every completion 0
            require_sandbox()
        except SandboxUnavailable as exc:
            raise TaskLoadError(f"task mbpp: {exc}") from None
        return super().load()

    def parse(self, row: dict) -> Problem:
        text = text_field(row, "text", "prompt")
        raw = list_field(row.get("test_list"), "test_list")
        if not all(isinstance(t, str) for t in raw):  # str(None) or str(1) would be a test any program passes
            raise RowError("test_list holds a non-string")
        tests = [t.strip() for t in raw if t.strip()]
        if not tests:
            raise RowError("no tests")
        if not all(_is_one_assert(t) for t in tests):
            raise RowError("a test is not one assert statement")
        imports = row.get("test_imports")  # the sanitized config's; the full config has test_setup_code
        imports = [] if imports is None else list_field(imports, "test_imports")
        setup_code = row.get("test_setup_code") or ""
        if not isinstance(setup_code, str) or not all(isinstance(x, str) for x in imports):
            raise RowError("test_setup_code or test_imports holds a non-string")
        setup = "\n".join([setup_code] + imports)
        return Problem(
            question=PROMPT.format(text=text, tests="\n".join(tests)),
            answer=tuple(tests),
            meta={
                "setup": setup.strip(),
                "task_id": row.get("task_id"),
                "entry": task_functions(row.get("code") or ""),
            },
        )

    def program(self, completion: str, problem: Problem) -> str:
        return build_program(extract_code(completion), problem.answer, problem.meta["setup"])

    def reward(self, completion: str, problem: Problem) -> float:
        result = run_python(
            self.program(completion, problem),
            self.sandbox_limits,
            n_tests=len(problem.answer),
            setup=problem.meta["setup"],
            entry=problem.meta.get("entry", ()),
        )
        if result.status in SANDBOX_FAILURES:
            raise GraderFailure(SANDBOX_FAILURES[result.status], "mbpp sandbox")
        return 1.0 if result.passed else 0.0

    def grade_batch(self, completions: list[str], problems: list[Problem]) -> list[Grade]:
        programs = [self.program(c, p) for c, p in zip(completions, problems)]
        return grade_programs(
            programs,
            self.sandbox_limits,
            self.sandbox_workers,
            [len(p.answer) for p in problems],
            [p.meta["setup"] for p in problems],
            [p.meta.get("entry", ()) for p in problems],
        )

    def grade(self, completion: str, problem: Problem) -> Grade:
        return self.grade_batch([completion], [problem])[0]
