"""How MBPP's test lists split under the sandbox's check (es_ray/grading/verdict.py), per file.

    python benchmarks/mbpp_shapes.py mbpp.jsonl sanitized-mbpp.json

Each row's reference ``code`` is the program and its ``test_list`` the tests (``test_setup_code`` or
``test_imports`` the setup). A test is one of: ``literal`` (``call == literal``, compared by the grader itself),
``check`` (evaluated in the separate check process over the probes' values), ``recorded`` (a comprehension,
generator expression or lambda over the program's names: recorded in the program's process, replayed in the
check), and, on top, ``two_ways`` (it uses a builtin's name the program binds: checked with both). Prints, per
file, how many test lists hold at least one test of each shape and how many tests each shape has, as JSON.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from es_ray.grading.verdict import split_tests


def rows(path: Path) -> list[dict]:
    text = path.read_text()
    return json.loads(text) if text.lstrip().startswith("[") else [json.loads(x) for x in text.splitlines() if x]


def shapes(row: dict) -> Counter:
    setup = row.get("test_setup_code") or "\n".join(row.get("test_imports") or [])
    program = "\n".join([row["code"], *(t.strip() for t in row["test_list"])]) + "\n"
    split = split_tests(program, setup)
    out: Counter = Counter()
    for test in split.tests:
        probes = [split.probes[i] for i in test["probes"]]
        out[
            "recorded"
            if any(isinstance(p, dict) for p in probes)
            else "literal"
            if test["expected"] is not None
            else "check"
        ] += 1
    sources = Counter(t["source"] for t in split.tests)
    out["two_ways"] = sum(n - 1 for n in sources.values())
    if split.asserts != len(row["test_list"]):
        out["not_split"] += 1  # the reference program does not end with its tests as separate asserts
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+", type=Path)
    for path in ap.parse_args().files:
        lists, tests, total = Counter(), Counter(), 0
        for row in rows(path):
            total += 1
            got = shapes(row)
            tests.update(got)
            lists.update(k for k, v in got.items() if v)
        print(json.dumps({"file": str(path), "test_lists": total, "lists_with": dict(lists), "tests": dict(tests)}))


if __name__ == "__main__":
    main()
