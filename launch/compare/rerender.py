"""Rewrite a comparison's report.md (and report.json's verdict) from its report.json, without running anything:
for a report written before the primary family (docs/results/cpu-demo/).

    python -m es_ray.launch.compare.rerender docs/results/cpu-demo

A report.json that holds the verdict is only re-rendered. One without it gets the paper's claims for its methods
from the paired tests' summaries it kept (launch.compare.verdict.stored_section: estimates, intervals, one-sided
bounds, the seeds a method-level claim needs; not the checkpoint test nor the detectable sizes, which need the
per-problem scores), and its exploratory tests lose the fields the previous rule derived from them (a verdict per
cell and a detectable size at the 95% bound of the training variance). A sensitivity.md beside it (the sensitivity
stage's section, launch/compare/sensitivity.py) is appended again, as the stage appended it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

OLD_FIELDS = ("separable", "testable", "detectable", "alpha_power", "can_plan", "problems_needed", "seeds_needed")


def rerender(folder: Path, margin: float = 0.02, alpha: float = 0.05) -> dict:
    from es_ray.launch.compare.markdown import markdown
    from es_ray.launch.compare.verdict import stored_section
    from es_ray.metrics.verdict import default_claims

    rep = json.loads((folder / "report.json").read_text())
    if "verdict" not in rep:
        for t in rep["comparisons"]["tests"]:
            for key in OLD_FIELDS:
                t.pop(key, None)
        rep["comparisons"].pop("alpha_first", None)
        rep["verdict"] = stored_section(rep, default_claims(list(rep["methods"]), rep["k"]), margin, alpha)
    (folder / "report.json").write_text(json.dumps(rep, indent=2))
    text = markdown(rep)
    if (folder / "sensitivity.md").is_file():  # the sensitivity stage appends its section after report.json is written
        text += "\n" + (folder / "sensitivity.md").read_text()
    (folder / "report.md").write_text(text)
    return rep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path, help="the folder holding report.json")
    ap.add_argument("--margin", type=float, default=0.02, help="verdict.margin for a report without a verdict")
    args = ap.parse_args()
    if not (args.folder / "report.json").is_file():
        raise SystemExit(f"rerender: {args.folder / 'report.json'} not found; give the folder holding report.json")
    if not args.margin > 0:
        raise SystemExit(2)
    rerender(args.folder, args.margin)
    print(f"rerender: wrote {args.folder / 'report.md'}")


if __name__ == "__main__":
    main()
