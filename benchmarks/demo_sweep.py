"""Step-size sweep for the CPU demo: runs es-train per (sigma, lr) and prints the reward trend side by side.

    python benchmarks/demo_sweep.py --iterations 12 --grid 2e-3:4e-6 5e-3:2.5e-5 1e-2:1e-4 -- es.population=8

For each setting: mean reward/mean over the first three and the last three iterations and the difference.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=12)
    ap.add_argument("--grid", nargs="+", default=["2e-3:4e-6", "5e-3:2.5e-5", "1e-2:1e-4"], help="sigma:lr pairs")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--root", default="")
    ap.add_argument("overrides", nargs="*", help="extra es-train overrides (after --)")
    args = ap.parse_args()
    root = Path(args.root or tempfile.mkdtemp(prefix="es-sweep-")).resolve()
    rows = []
    for pair in args.grid:
        sigma, lr = pair.split(":")
        for seed in args.seeds:
            run_dir = root / f"sigma{sigma}_lr{lr}_seed{seed}"
            cmd = [
                "es-train",
                f"es.sigma={sigma}",
                f"es.lr={lr}",
                f"es.iterations={args.iterations}",
                f"run.seed={seed}",
                f"run.dir={run_dir}",
                "run.progress=false",
                *args.overrides,
            ]
            t0 = time.time()
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            rewards = [json.loads(x)["reward/mean"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
            first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
            rows.append((sigma, lr, seed, first, last, last - first, time.time() - t0))
            print(
                f"sigma={sigma} lr={lr} seed={seed}: first3={first:.4f} last3={last:.4f} "
                f"delta={last - first:+.4f} ({time.time() - t0:.0f} s) rewards={[round(r, 3) for r in rewards]}",
                flush=True,
            )
    print(f"\nruns under {root}")


if __name__ == "__main__":
    sys.exit(main())
