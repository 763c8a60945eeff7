"""Recovery from a killed ES actor: how long it takes and how many bytes it sends, beside the model's size.

    python benchmarks/recovery.py                       # embedded SmolLM2-135M, 2 actors, actor 1 killed at it. 3
    python benchmarks/recovery.py --verify              # also run without the fault and compare the final weights
    python benchmarks/recovery.py -- engine.name=vllm cluster.gpus_per_actor=1

Runs es-train with `faults.kill_actor_at_iteration` (the actor's process exits after scoring its first member of
that iteration) and a checkpoint every `--checkpoint-every` iterations, then reads the recovery metrics: the
replacement's start time, its rebuild time (load the checkpoint from disk, replay the logged updates since it),
the bytes the driver sent to rebuild it (the actor's constructor arguments and the seed-log records: integers and
floats) against the model's fp32 size, and the killed iteration's wall time against the median of the others.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from pathlib import Path

# torch is imported where a checkpoint is written: --help needs no torch.


def es_train(run_dir: Path, args: argparse.Namespace, extra: list[str]) -> list[dict]:
    cmd = [
        "es-train",
        f"run.dir={run_dir}",
        f"es.iterations={args.iterations}",
        f"es.population={args.population}",
        f"es.prompts_per_iteration={args.prompts}",
        f"sampling.max_new_tokens={args.max_new_tokens}",
        f"cluster.num_actors={args.actors}",
        f"run.checkpoint_every={args.checkpoint_every}",
        "eval.every=0",
        "run.progress=false",
        "run.trackers=[]",
        *extra,
        *args.overrides,
    ]
    subprocess.run(cmd, check=True)
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def same_weights(a: Path, b: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--kill-at", type=int, default=3)
    ap.add_argument("--rank", type=int, default=1)
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--population", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--checkpoint-every", type=int, default=2)
    ap.add_argument("--verify", action="store_true", help="also run without the fault; compare final weights")
    ap.add_argument("overrides", nargs="*", help="es-train overrides")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="es-recovery-"))

    killed = root / "killed"
    rows = es_train(killed, args, [f"faults.kill_actor_at_iteration={args.kill_at}", f"faults.actor_rank={args.rank}"])
    event = rows[args.kill_at]
    others = [r["timing_s/iteration"] for i, r in enumerate(rows) if i not in (0, args.kill_at)]
    model_bytes, sent = event["recovery/model_bytes"], event["recovery/bytes_sent"]
    print(
        f"killed actor {args.rank} at iteration {args.kill_at} (checkpoint every {args.checkpoint_every}); "
        f"replacements: {event['recovery/replacements']}, updates replayed: {event['recovery/replayed']}"
    )
    print(f"recovery time (start + rebuild): {event['recovery/seconds']:.2f} s")
    print(f"bytes sent to rebuild:           {sent} B")
    print(
        f"model size (fp32):               {model_bytes} B ({model_bytes / 2**20:.1f} MiB); "
        f"sent / model = {sent / model_bytes:.2e}"
    )
    print(
        f"iteration wall time: killed {event['timing_s/iteration']:.2f} s, others median "
        f"{statistics.median(others):.2f} s"
    )
    if args.verify:
        clean = root / "clean"
        es_train(clean, args, [])
        same = same_weights(killed / "checkpoints" / "final", clean / "checkpoints" / "final")
        print(f"final weights equal to the run without the fault: {same}")
        if not same:
            raise SystemExit(1)
    print(f"runs under {root}")


if __name__ == "__main__":
    main()
