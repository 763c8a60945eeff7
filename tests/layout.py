"""Where a test module goes: tests/ mirrors the package (docs/running.md "Where a test goes").

A test module sits in the folder of the code it tests: the package's parts by their installed names (es_ray.grpo is
tests/grpo/, es_ray.launch.compare is tests/launch/compare/), es_ray's top-level modules in the folder of the part
they serve (``AREAS``), the repository's scripts/ and benchmarks/ in tests/scripts/ and tests/benchmarks/, and
checks over the whole repository or the suite itself in tests/repo/. Only shared code stays at the top of tests/
(conftest.py, helpers.py, paths.py, this file, es_test_tasks.py, strict_collectives.py, fixtures/).

``suggest`` reads a test module's own imports and names the folder of the part it imports most: run
``python tests/layout.py`` to print a ``git mv`` for every test module left at the top of tests/
(tests/repo/test_suite_layout.py fails on one and names its folder the same way).
"""

from __future__ import annotations

import ast
import sys
from collections import Counter
from pathlib import Path

from paths import TESTS

AREAS = {
    "es_ray.core": "core",
    "es_ray.engines": "engines",
    "es_ray.memory_plan": "engines",
    "es_ray.model_shape": "engines",
    "es_ray.engine_memory": "engines",
    "es_ray.es": "es",
    "es_ray.strategy": "es",
    "es_ray.noise": "es",
    "es_ray.noise_kinds": "es",
    "es_ray.perturbation": "es",
    "es_ray.lowrank": "es",
    "es_ray.replica": "es",
    "es_ray.replica_spec": "es",
    "es_ray.replica_memory": "es",
    "es_ray.evaluation": "evaluation",
    "es_ray.grading": "grading",
    "es_ray.metrics": "metrics",
    "es_ray.runtime": "runtime",
    "es_ray.held_out": "runtime",
    "es_ray.tasks": "tasks",
    "es_ray.grpo": "grpo",
    "es_ray.launch": "launch",
    "es_ray.launch.compare": "launch/compare",
}
"""A module of the package (its installed name, or a prefix of it) -> its folder under tests/; the longest prefix
naming a module wins. es_ray.models (the model a test loads) names no folder."""
WHOLE_REPOSITORY = ("repo", "scripts", "benchmarks")
"""The folders of tests that import no part of the package: checks over the repository or the suite (repo), and
tests of scripts/ and benchmarks/."""
FOLDERS = tuple(sorted(set(AREAS.values()) | set(WHOLE_REPOSITORY)))
SHARED = {"conftest.py", "helpers.py", "paths.py", "layout.py", "es_test_tasks.py", "strict_collectives.py"}
"""The modules that stay at the top of tests/, importable from every folder (conftest puts tests/ on sys.path)."""
WEAK = {"core"}
"""Imported by nearly every test for its config sections: counts only where nothing else is imported."""


def area_of(module: str) -> str | None:
    hits = [p for p in AREAS if module == p or module.startswith(p + ".")]
    return AREAS[max(hits, key=len)] if hits else None


def imported_areas(source: str) -> Counter:
    """How many import statements of ``source`` (function-local ones included) name each folder's code."""
    counts: Counter = Counter()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        counts.update({area for area in map(area_of, names) if area})
    return counts


def suggest(path: Path) -> str:
    """The folder under tests/ for the test module at ``path``: the folder its name starts with (test_grpo_sync.py:
    grpo), else the area it imports most (ties: the first of them in ``FOLDERS``), else "repo" where it imports no
    part of the package (tests/scripts/ or tests/benchmarks/ instead where it tests a file there)."""
    named = [f for f in FOLDERS if "/" not in f and (path.stem == f"test_{f}" or path.stem.startswith(f"test_{f}_"))]
    if named:
        return named[0]
    counts = imported_areas(path.read_text())
    strong = Counter({a: n for a, n in counts.items() if a not in WEAK}) or counts
    if not strong:
        return "repo"
    top = max(strong.values())
    return min(a for a, n in strong.items() if n == top)


def misplaced() -> list[tuple[Path, str]]:
    """(test module at the top of tests/, the folder it belongs in)."""
    return [(p, suggest(p)) for p in sorted(TESTS.glob("test_*.py"))]


if __name__ == "__main__":
    moves = misplaced()
    for path, folder in moves:
        print(f"git mv tests/{path.name} tests/{folder}/{path.name}")
    sys.exit(1 if moves else 0)
