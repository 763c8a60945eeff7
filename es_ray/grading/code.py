"""MBPP-style code grading: take the program out of a completion, append the task's tests, run it sandboxed.

The tests are the program's trailing asserts; the sandbox checks them outside the program's process
(es_ray.grading.verdict), and a program whose code swallowed some of them (fewer trailing asserts than tests)
fails."""

from __future__ import annotations

import ast
import re
from typing import Sequence

from es_ray.grading.result import Grade
from es_ray.grading.sandbox import SandboxLimits, SandboxResult, run_many

# the language tag owns the spaces after it (linear: "```" + spaces without a newline backtracked as n^2)
_FENCE = re.compile(r"```[ \t]*(?:([\w+-]+)[ \t]*)?\n(.*?)(?:```|\Z)", re.S)
# sandbox statuses that are grading failures (counted by kind); "failed" is an ordinary wrong answer
SANDBOX_FAILURES = {
    "timeout": "timeout",
    "memory": "memory",
    "output_limit": "output_limit",
    "escape_attempt": "escape_attempt",
    "unparseable_result": "unparseable_result",
    "too_long": "too_long",
    "error": "unavailable",
}


def extract_code(completion: str) -> str:
    """The first fenced block that defines something (```python preferred), else the first block, else the text.

    An unterminated fence (a completion cut at max_new_tokens) runs to the end of the text.
    """
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(completion)]
    if not blocks:
        return completion.strip()
    for want in (
        lambda lang, body: lang in ("python", "py", "python3") and "def " in body,
        lambda lang, body: "def " in body,
        lambda lang, body: True,
    ):
        for lang, body in blocks:
            if want(lang, body):
                return body.strip()
    return blocks[0][1].strip()


def _setup_parts(setup: str) -> tuple[str, str]:
    """The task's setup code as (its imports, the rest): the rest may use the candidate's names (MBPP 367 and 927
    build trees of the task's ``Node`` class), so it runs after the candidate, as in MBPP's own harness."""
    try:
        body = ast.parse(setup).body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return setup.strip(), ""
    if all(isinstance(n, (ast.Import, ast.ImportFrom)) for n in body):
        return setup.strip(), ""
    imports = [ast.unparse(n) for n in body if isinstance(n, (ast.Import, ast.ImportFrom))]
    rest = [ast.unparse(n) for n in body if not isinstance(n, (ast.Import, ast.ImportFrom))]
    return "\n".join(imports), "\n".join(rest)


def build_program(code: str, tests: Sequence[str], setup: str = "") -> str:
    """Setup's imports (what the tests need), then the candidate, then the rest of the setup (it may use the
    candidate's names), then the asserts."""
    imports, rest = _setup_parts(setup)
    parts = [imports, code, rest, "\n".join(t.strip() for t in tests)]
    return "\n\n".join(p for p in parts if p) + "\n"


def grade_results(results: Sequence[SandboxResult]) -> list[Grade]:
    return [Grade(1.0 if r.passed else 0.0, r.passed, SANDBOX_FAILURES.get(r.status)) for r in results]


def grade_programs(
    programs: Sequence[str],
    limits: SandboxLimits = SandboxLimits(),
    workers: int = 2,
    n_tests: Sequence[int | None] | None = None,
    setups: Sequence[str] | None = None,
    entries: Sequence[Sequence[str]] | None = None,
) -> list[Grade]:
    return grade_results(run_many(programs, limits, workers, n_tests, setups, entries))
