"""GRPO on the CPU demo, separate (a learner actor and a rollout actor) against colocated (grpo.colocate=true: one
actor holding both), side by side in one process: wall time per step and in all, and the device-seconds the ledger
counts. Same seeds, so both runs train on the same samples while their weights agree.

    python benchmarks/grpo_colocate.py --steps 2 --rounds 2 --out /tmp/grpo_colocate

Prints one JSON line. The demo model is the embedded SmolLM2-135M; on a shared machine the times carry the other
load, so compare the two runs with each other, not with another day's numbers.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

# The GRPO modules are imported in the run: --help needs no numpy or Ray.


def one_run(colocate: bool, steps: int, out: Path) -> dict:
    from es_ray.grpo.config import to_grpo_config
    from es_ray.grpo.driver import run

    run_dir = out / ("colocated" if colocate else "separate")
    cfg = to_grpo_config(
        {
            "grpo": {"steps": steps, "colocate": colocate},
            "eval": {"every": 0},
            "cluster": {"num_actors": 1, "cpus_per_actor": 1},
            "run": {"dir": str(run_dir), "progress": False, "trackers": [], "overwrite": True},
        }
    )
    t0 = time.perf_counter()
    run(cfg)
    wall = time.perf_counter() - t0
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    ledger = json.loads((run_dir / "ledger.json").read_text())
    return {
        "wall_s": round(wall, 1),
        "step_s": [round(r["timing_s/step"], 1) for r in rows],
        "generate_s": [round(r["timing_s/generate"], 1) for r in rows],
        "train_s": [round(r["timing_s/train"], 1) for r in rows],
        "sync_s": [round(r["timing_s/sync"], 2) for r in rows],
        "reward_mean": [r["reward/mean"] for r in rows],
        "actors": len(ledger["actors"]),
        "device_s": round(ledger["device_seconds"], 1),
        "device_s_training": round(ledger["device_seconds_training"], 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", default="/tmp/grpo_colocate")
    ap.add_argument("--rounds", type=int, default=1, help="alternate the two this many times (load drifts)")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    result: dict = {"separate": [], "colocated": []}
    for r in range(args.rounds):  # ABBA-style: the order flips every round
        order = (False, True) if r % 2 == 0 else (True, False)
        for colocate in order:
            result["colocated" if colocate else "separate"].append(one_run(colocate, args.steps, out))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
