"""Share of an ES iteration spent outside generation, per noise source, measured side by side in one run.

    python benchmarks/es_overhead.py                      # default model and configuration, 4 iterations each
    python benchmarks/es_overhead.py --iterations 6 -- es.population=16

For each noise source it runs es-train (the default configuration plus the overrides), then prints per-iteration
medians: wall seconds, generation seconds (slowest actor), and the share outside generation: noise and weight
writes (perturb, restore), the update (regenerated noise, optimizer, write), Ray messages and driver work. The
first iteration is dropped (warm-up). The goal is under 5%.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from pathlib import Path


def measure(noise: str, iterations: int, overrides: list[str], root: Path) -> dict:
    run_dir = root / f"noise-{noise}"
    cmd = [
        "es-train",
        f"es.noise={noise}",
        f"es.iterations={iterations}",
        f"run.dir={run_dir}",
        "run.progress=false",
        "run.trackers=[]",
        "eval.every=0",
        *overrides,
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]

    def med(key: str) -> float:
        return statistics.median(r.get(key, 0.0) for r in rows)

    shares = [1 - (r["timing_s/generate"] + r["timing_s/reward"]) / r["timing_s/iteration"] for r in rows]
    return {
        "noise": noise,
        "iteration_s": med("timing_s/iteration"),
        "generate_s": med("timing_s/generate"),
        "perturb_s": med("timing_s/perturb"),
        "restore_s": med("timing_s/restore"),
        "update_s": med("timing_s/update"),
        "tokens_per_s": med("perf/tokens_per_s"),
        "outside_share": statistics.median(shares),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--noise", nargs="+", default=["table", "per_tensor"])
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="es-overhead-"))
    results = [measure(n, args.iterations + 1, args.overrides, root) for n in args.noise]
    print(
        f"{'noise':<11}{'iter s':>9}{'gen s':>9}{'perturb s':>11}{'restore s':>11}{'update s':>10}"
        f"{'tok/s':>9}{'outside':>9}"
    )
    for r in results:
        print(
            f"{r['noise']:<11}{r['iteration_s']:>9.2f}{r['generate_s']:>9.2f}{r['perturb_s']:>11.2f}"
            f"{r['restore_s']:>11.3f}{r['update_s']:>10.2f}{r['tokens_per_s']:>9.1f}{r['outside_share']:>9.1%}"
        )
    if len(results) == 2:
        a, b = results
        print(
            f"ratio of iteration time {b['noise']}/{a['noise']}: {b['iteration_s'] / a['iteration_s']:.2f}x; "
            f"outside-generation share goal < 5%"
        )
    print(f"runs under {root}")


if __name__ == "__main__":
    main()
