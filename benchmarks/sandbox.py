"""Cost of the MBPP code sandbox per program, this tree beside an earlier revision, on the same machine.

    python benchmarks/sandbox.py --ref a6d15f1 --n 20

Three MBPP-shaped programs (tests of the form ``call == literal``, compared by the grader; a test that needs the
separate check process; a wrong answer), each run ``--n`` times one after another (workers=1), interleaved
between the two trees round by round so that load on the machine hits both alike. Prints the median and the
quartiles in ms/program per shape and tree, as JSON lines. ``--ref`` takes any git revision: its ``es_ray``
package is extracted to a temporary directory and imported there in a subprocess.

    python benchmarks/sandbox.py --split

The grader's own cost before any program runs: ``split_tests`` on candidates of 8 to 128 KiB (the size cap,
``MAX_PROGRAM_BYTES``), median of 3 each, and the ratio per doubling (2.0 is linear).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from es_ray.grading.sandbox import MAX_PROGRAM_BYTES, SandboxLimits, require_sandbox, run_python
from es_ray.grading.verdict import split_tests

ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = {
    "literal": "def add(a, b):\n    return a + b\n\n"
    "assert add(1, 2) == 3\nassert add(2, 2) == 4\nassert add(0, 0) == 0\n",
    "check": "def pairs(xs):\n    return {(x, x * 2) for x in xs}\n\nassert pairs([1, 2]) == {(1, 2), (2, 4)}\n"
    "assert set(pairs([3])) == set([(3, 6)])\nassert all(p in pairs([1]) for p in [(1, 2)])\n",
    "wrong": "def add(a, b):\n    return a - b\n\nassert add(1, 2) == 3\n",
}


def one_round(shape: str) -> float:
    """Run one program in this interpreter's es_ray; seconds."""
    t0 = time.perf_counter()
    res = run_python(PROGRAMS[shape], SandboxLimits())
    elapsed = time.perf_counter() - t0
    if res.passed != (shape != "wrong"):
        raise SystemExit(f"{shape}: unexpected {res.status}: {res.stderr[-500:]}")
    return elapsed


def _worker(shape: str, n: int) -> None:
    require_sandbox()  # the once-per-process plan (and its probe run) is not a per-program cost
    print(json.dumps([one_round(shape) for _ in range(n)]))


def _run(tree: Path, shape: str, n: int) -> list[float]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run(
        [sys.executable, __file__, "--worker", shape, "--n", str(n)],
        env=env,
        cwd=tree,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def split_costs() -> None:
    last = None
    for kib in (8, 16, 32, 64, MAX_PROGRAM_BYTES >> 10):
        n = (kib << 10) // 14 - 40
        program = "def f(x):\n    return x\n" + "y = [1, 2, 3]\n" * n + "assert f(1) == 1\n" * 30
        xs = []
        for _ in range(3):
            t0 = time.perf_counter()
            split_tests(program, "", 30)
            xs.append(time.perf_counter() - t0)
        med = statistics.median(xs)
        print(
            json.dumps(
                {
                    "split_kib": kib,
                    "bytes": len(program),
                    "median_ms": round(1e3 * med, 1),
                    "ratio_per_doubling": round(med / last, 2) if last else None,
                }
            )
        )
        last = med


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ref", default="", help="git revision to compare against (its es_ray package)")
    ap.add_argument("--n", type=int, default=20, help="programs per shape and tree")
    ap.add_argument("--rounds", type=int, default=4, help="interleaved rounds (n is split over them)")
    ap.add_argument("--split", action="store_true", help="the grader's split_tests cost up to the size cap")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.split:
        split_costs()
        return
    if args.worker:
        _worker(args.worker, args.n)
        return
    trees = {"this tree": ROOT}
    with tempfile.TemporaryDirectory(prefix="es-ray-bench-") as tmp:
        if args.ref:
            archive = subprocess.run(
                ["git", "-C", str(ROOT), "archive", args.ref, "es_ray"], capture_output=True, check=True
            ).stdout
            subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
            trees[args.ref] = Path(tmp)
        times: dict[tuple[str, str], list[float]] = {}
        per_round = max(1, args.n // args.rounds)
        for _ in range(args.rounds):
            for shape in PROGRAMS:
                for name, tree in trees.items():
                    times.setdefault((name, shape), []).extend(_run(tree, shape, per_round))
    for (name, shape), xs in sorted(times.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        q = statistics.quantiles(xs, n=4) if len(xs) > 1 else xs * 3
        print(
            json.dumps(
                {
                    "tree": name,
                    "shape": shape,
                    "programs": len(xs),
                    "median_ms": round(1e3 * q[1], 1),
                    "q1_ms": round(1e3 * q[0], 1),
                    "q3_ms": round(1e3 * q[2], 1),
                }
            )
        )


if __name__ == "__main__":
    main()
