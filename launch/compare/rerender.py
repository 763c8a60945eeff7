"""Rewrite a comparison's report.md and report.json with this code, without training or evaluating anything.

    python -m es_ray.launch.compare.rerender RUN_DIR             # an es-compare run.dir: the report rebuilt
    python -m es_ray.launch.compare.rerender docs/results/cpu-demo  # a folder holding report.json only

A run.dir (compare_config.json and stages/ beside report.json) gets its whole report rebuilt from the stages' own
files (launch.compare.report.write_report with the stored configuration: every evaluation's samples.jsonl, the
ledgers, the drift reports), so a run made by earlier code is reported by this code; no Ray, no model, and the
stages' settings are not checked against this code's (repeating the es-compare command also rewrites the report,
but refuses when this code's stage settings gained a key). A report.json alone is recomputed from what it kept: one
with the per-problem record (``per_problem``: the correct counts and entropy sums of every method, seed, task and
problem) gets every test again (the comparisons, the primary family's checkpoint and method-level tests, detectable
sizes, the seeds and problems needed), at the family it declared or at --margin / --alpha where given. One written
before that record (docs/results/cpu-demo/ before this change) keeps the tests it stored; one without a verdict gets
the paper's claims from the paired tests' summaries it kept (launch.compare.verdict.stored_section: estimates,
intervals, one-sided bounds, the seeds a method-level claim needs; not the checkpoint test nor the detectable sizes),
and its exploratory tests lose the fields the previous rule derived from them. A sensitivity.md beside it (the
sensitivity stage's section, launch/compare/sensitivity.py) is appended again, as the stage appended it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

from es_ray.core.config import to_config

# The report, the comparison's config and the verdict (numpy, scipy) are imported where used: --help and a bad
# argument answer without them.

OLD_FIELDS = ("separable", "testable", "detectable", "alpha_power", "can_plan", "problems_needed", "seeds_needed")


def is_run_dir(folder: Path) -> bool:
    """An es-compare run.dir: its configuration and its stages are there."""
    return (folder / "compare_config.json").is_file() and (folder / "stages").is_dir()


def from_run_dir(folder: Path) -> dict:
    """The report of an es-compare run.dir rebuilt from its stages' files with this code (write_report)."""
    from es_ray.launch.compare.report import write_report
    from es_ray.launch.compare.config import CompareConfig, pool_size, training_tasks
    from es_ray.launch.compare.stages import interpolation_plan, stage_plan

    cfg = to_config(json.loads((folder / "compare_config.json").read_text()), CompareConfig)
    root = folder.resolve()
    pools = {t: pool_size(cfg, t) for t in training_tasks(cfg)}
    plan = {m: {s: stage_plan(cfg, m, root, pools, s) for s in cfg.seeds} for m in cfg.methods}
    paths = {s: interpolation_plan(cfg, root, s) for s in cfg.seeds}
    missing = [
        st.name
        for by_seed in plan.values()
        for stages in by_seed.values()
        for st in stages
        if not (st.dir(root) / "done.json").is_file()
    ]
    if missing:
        raise SystemExit(
            f"rerender: {folder} has unfinished stages ({', '.join(missing[:4])}); finish them with "
            "the es-compare command (same run.dir) first"
        )
    return write_report(root, cfg, plan, pools[training_tasks(cfg)[0]], paths)


def stored_config(rep: dict, margin: float | None, alpha: float | None):
    """The verdict's settings as report.json recorded them (a declared family kept, the paper's otherwise), with
    --margin / --alpha in their place where given: what launch.compare.verdict.primary_section reads."""
    from es_ray.launch.compare.verdict import VerdictConfig

    v = rep.get("verdict") or {}
    return SimpleNamespace(
        verdict=VerdictConfig(
            primary=list(v.get("claims", [])) if v.get("declared") else [],
            margin=v.get("margin", 0.02) if margin is None else margin,
            alpha=v.get("alpha", 0.05) if alpha is None else alpha,
        ),
        eval=SimpleNamespace(k=rep["k"]),
        methods=list(rep["methods"]),
    )


def check_record(rep: dict) -> None:
    """A stored report.json's per-problem record (launch.compare.report.per_problem_counts) is whole and consistent
    before any test is recomputed from it: every task and method the report names, the same seed count for every
    method (as launch.compare.verdict.check_seeds refuses before training) and as ``seeds``, one row of each seed per
    stored problem, and correct counts in [0, eval.n]. ValueError naming the key otherwise."""
    for key in ("k", "tasks", "methods", "seeds"):
        if key not in rep:
            raise ValueError(f"report.json has no {key!r}: not an es-compare report")
    pp = rep["per_problem"]
    if not isinstance(pp, dict) or not {"n", "problems", "methods"} <= set(pp):
        raise ValueError(
            "per_problem must hold 'n', 'problems' and 'methods' (launch.compare.report."
            "per_problem_counts); remove per_problem to keep the stored tests"
        )
    n, tasks = pp["n"], list(rep["tasks"])
    if not (isinstance(n, int) and n >= 1):
        raise ValueError(f"per_problem.n={n!r}: give eval.n, the samples per problem (an integer >= 1)")
    missing = [t for t in tasks if t not in pp["problems"]]
    if missing:
        raise ValueError(f"per_problem.problems lacks the task(s) {missing} the report names (tasks={tasks})")
    seeds = len(rep["seeds"])
    for m, by_task in pp["methods"].items():
        for t in tasks:
            rec, where = (by_task or {}).get(t), f"per_problem.methods.{m}.{t}"
            if not isinstance(rec, dict):
                raise ValueError(f"{where} is missing: every method with samples answers every task")
            for key in ("correct", "entropy_sum", "entropy_tokens"):
                rows = rec.get(key)
                if not isinstance(rows, list) or len(rows) != seeds:
                    raise ValueError(
                        f"{where}.{key} has {len(rows) if isinstance(rows, list) else 'no'} seed rows, "
                        f"the report's seeds {rep['seeds']} need {seeds} (seeds must not differ between "
                        "methods)"
                    )
                if any(not isinstance(r, list) or len(r) != len(pp["problems"][t]) for r in rows):
                    raise ValueError(
                        f"{where}.{key}: every seed's row needs one value per stored problem "
                        f"({len(pp['problems'][t])}, per_problem.problems.{t})"
                    )
            bad = [c for r in rec["correct"] for c in r if not (isinstance(c, int) and 0 <= c <= n)]
            if bad:
                raise ValueError(
                    f"{where}.correct holds {bad[0]!r}: a count of correct completions in [0, {n}] (per_problem.n)"
                )


def rerender(folder: Path, margin: float | None = None, alpha: float | None = None) -> dict:
    from es_ray.launch.compare.markdown import markdown
    from es_ray.launch.compare.report import tested
    from es_ray.launch.compare.verdict import stored_section
    from es_ray.metrics.verdict import default_claims

    if is_run_dir(folder) and margin is None and alpha is None:
        rep = from_run_dir(folder)
    else:
        try:
            rep = json.loads((folder / "report.json").read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{folder / 'report.json'} is not JSON ({e})") from None
        if not isinstance(rep, dict):
            raise ValueError(f"{folder / 'report.json'} holds no report object")
        if "per_problem" in rep:
            check_record(rep)
            tested(rep, stored_config(rep, margin, alpha))
        elif "verdict" not in rep:
            for t in rep["comparisons"]["tests"]:
                for key in OLD_FIELDS:
                    t.pop(key, None)
            rep["comparisons"].pop("alpha_first", None)
            rep["verdict"] = stored_section(
                rep,
                default_claims(list(rep["methods"]), rep["k"]),
                0.02 if margin is None else margin,
                0.05 if alpha is None else alpha,
            )
        (folder / "report.json").write_text(json.dumps(rep, indent=2))
        (folder / "report.md").write_text(markdown(rep))
    if (folder / "sensitivity.md").is_file():  # the sensitivity stage appends its section after report.json is written
        md = folder / "report.md"
        md.write_text(md.read_text() + "\n" + (folder / "sensitivity.md").read_text())
    return rep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path, help="an es-compare run.dir, or a folder holding its report.json")
    ap.add_argument(
        "--margin",
        type=float,
        default=None,
        help="verdict.margin to test at (default: the one report.json recorded, else 0.02); with a "
        "run.dir, the report.json there is recomputed at it instead of rebuilt from the stages",
    )
    ap.add_argument("--alpha", type=float, default=None, help="verdict.alpha, likewise (default: recorded, else 0.05)")
    args = ap.parse_args()
    bad = (
        f"{args.folder / 'report.json'} not found; give an es-compare run.dir or the folder holding report.json"
        if not (args.folder / "report.json").is_file() and not is_run_dir(args.folder)
        else f"--margin={args.margin}: give a non-inferiority margin > 0, e.g. --margin 0.02"
        if args.margin is not None and not args.margin > 0
        else f"--alpha={args.alpha}: give a family-wise error rate in (0, 1), e.g. --alpha 0.05"
        if args.alpha is not None and not 0 < args.alpha < 1
        else None
    )
    if bad:
        print(f"rerender: {bad}", file=sys.stderr)
        sys.exit(2)
    try:
        rerender(args.folder, args.margin, args.alpha)
    except ValueError as e:
        print(f"rerender: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"rerender: wrote {args.folder / 'report.md'} and report.json")


if __name__ == "__main__":
    main()
