"""MBPP (google-research-datasets/mbpp, config full, split test: 500 problems), graded by running the tests.

Rows (full) have ``task_id``, ``text``, ``code``, ``test_list``, ``test_setup_code`` and ``challenge_test_list``;
the sanitized config's rows (``prompt``, ``test_imports``, ``test_list``) load from ``task.path`` too. The prompt
is the usual MBPP one (the task and its tests) and asks for one ```python block. The completion's code, the setup
code and the asserts of ``test_list`` run in the sandbox (es_ray.grading.sandbox): reward 1 when every assert
holds. ``challenge_test_list`` is not used.
"""

from __future__ import annotations

from es_ray.grading.code import SANDBOX_FAILURES, build_program, extract_code, grade_programs
from es_ray.grading.result import Grade, GraderFailure
from es_ray.grading.sandbox import SandboxLimits, run_python
from es_ray.tasks.base import Problem
from es_ray.tasks.dataset import DatasetTask, RowError, list_field, text_field

PROMPT = ("You are an expert Python programmer, and here is your task: {text} Your code should pass these tests:"
          "\n\n{tests}\n\nWrite the complete solution in a single ```python code block.")


class MBPPTask(DatasetTask):
    name = "mbpp"
    hub_id, hub_configs, eval_split = "google-research-datasets/mbpp", ("full",), "test"
    sandbox_limits = SandboxLimits()
    """Limits for each program (es-eval sets eval.code_timeout_s / eval.code_memory_mb here)."""
    sandbox_workers = 2

    def parse(self, row: dict) -> Problem:
        text = text_field(row, "text", "prompt")
        tests = [str(t).strip() for t in list_field(row["test_list"], "test_list") if str(t).strip()]
        if not tests:
            raise RowError("no tests")
        imports = row.get("test_imports")  # the sanitized config's; the full config has test_setup_code
        imports = [] if imports is None else list_field(imports, "test_imports")
        setup = "\n".join([str(row.get("test_setup_code") or "")] + [str(x) for x in imports])
        return Problem(question=PROMPT.format(text=text, tests="\n".join(tests)), answer=tuple(tests),
                       meta={"setup": setup.strip(), "task_id": row.get("task_id")})

    def program(self, completion: str, problem: Problem) -> str:
        return build_program(extract_code(completion), problem.answer, problem.meta["setup"])

    def reward(self, completion: str, problem: Problem) -> float:
        result = run_python(self.program(completion, problem), self.sandbox_limits)
        if result.status in SANDBOX_FAILURES:
            raise GraderFailure(SANDBOX_FAILURES[result.status], "mbpp sandbox")
        return 1.0 if result.passed else 0.0

    def grade_batch(self, completions: list[str], problems: list[Problem]) -> list[Grade]:
        programs = [self.program(c, p) for c, p in zip(completions, problems)]
        return grade_programs(programs, self.sandbox_limits, self.sandbox_workers)

    def grade(self, completion: str, problem: Problem) -> Grade:
        return self.grade_batch([completion], [problem])[0]
