"""Peak memory per actor for ES and for GRPO on the same model and the same batch shape, in one run.

ES: one actor, population N = --group members x --prompts prompts x --tokens new tokens per iteration.
GRPO: one learner and one rollout actor, --prompts prompts x --group completions x --tokens new tokens per step.
Both sample at the same temperature. Each trainer writes run.dir/ledger.json (es_ray.runtime.ledger): the peak resident
set of each actor process (and the peak GPU allocation where there is one), measured by the actor itself. This
script runs both on one local Ray and prints the table and the GRPO / ES ratios.

    python benchmarks/memory.py                       # SmolLM2-135M, 4 prompts x 4, 8 tokens, 2 steps each
    python benchmarks/memory.py --model /abs/hf/dir --engine vllm --gpus 1
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from es_ray.runtime.ledger import FIELDS

# The drivers are imported in the run: --help needs no numpy or Ray.

GIB = 1 << 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="model.path (empty: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4, help="GRPO group size = ES population")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2, help="ES iterations = GRPO steps")
    ap.add_argument("--engine", default="hf")
    ap.add_argument("--gpus", type=float, default=0.0, help="cluster.gpus_per_actor")
    ap.add_argument("--out", default="", help="directory for both runs (default: a temporary one)")
    args = ap.parse_args()

    from es_ray.es.config import to_train_config
    from es_ray.es.driver import run as es_run
    from es_ray.grpo.config import to_grpo_config
    from es_ray.grpo.driver import run as grpo_run

    out = Path(args.out or tempfile.mkdtemp(prefix="memory-bench-")).resolve()
    common = {
        "model": {"path": args.model},
        "sampling": {"max_new_tokens": args.tokens, "temperature": 1.0},
        "eval": {"every": 0},
    }
    engine = {"name": args.engine}
    run_opts = {"progress": False, "trackers": []}
    es_cfg = to_train_config(
        {
            **common,
            "engine": engine,
            "es": {"population": args.group, "prompts_per_iteration": args.prompts, "iterations": args.steps},
            "cluster": {"num_actors": 1, "gpus_per_actor": args.gpus},
            "run": {"dir": str(out / "es"), **run_opts},
        }
    )
    grpo_cfg = to_grpo_config(
        {
            **common,
            "engine": {**engine, "threads": 1},
            "grpo": {"group_size": args.group, "prompts_per_step": args.prompts, "steps": args.steps},
            "cluster": {"num_actors": 1, "gpus_per_actor": args.gpus},
            "run": {"dir": str(out / "grpo"), **run_opts},
        }
    )
    es_run(es_cfg)
    grpo_run(grpo_cfg)
    ledgers = {m: json.loads((out / m / "ledger.json").read_text()) for m in ("es", "grpo")}
    print(
        f"\nbatch: {args.prompts} prompts x {args.group} (ES members / GRPO group) x {args.tokens} new tokens, "
        f"{args.steps} iterations/steps, engine {args.engine}, runs in {out}\n"
    )
    print("| method | actor | peak RSS GiB | peak GPU GiB |")
    print("|---|---|---|---|")
    for m, led in ledgers.items():
        for role, mem in led["actors"].items():
            gpu = f"{mem['peak_gpu_bytes'] / GIB:.2f}" if mem.get("peak_gpu_bytes") else "-"
            print(f"| {m} | {role} | {mem['peak_rss_bytes'] / GIB:.2f} | {gpu} |")
    es_mem, grpo_mem = ledgers["es"]["actors"], ledgers["grpo"]["actors"]
    es_max = max(m["peak_rss_bytes"] for m in es_mem.values())
    es_sum = sum(m["peak_rss_bytes"] for m in es_mem.values())
    grpo_sum = sum(m["peak_rss_bytes"] for m in grpo_mem.values())
    print(
        f"\nGRPO / ES peak RSS: largest actor {grpo_mem['learner_0']['peak_rss_bytes'] / es_max:.2f}x "
        f"(learner vs ES actor), all actors {grpo_sum / es_sum:.2f}x"
    )
    gpu = {
        m: [x["peak_gpu_bytes"] for x in led["actors"].values() if x.get("peak_gpu_bytes")]
        for m, led in ledgers.items()
    }
    if gpu["es"] and gpu["grpo"]:
        print(f"GRPO / ES peak GPU memory (largest actor): {max(gpu['grpo']) / max(gpu['es']):.2f}x")
    print("\nThe two ledgers side by side (es_ray.runtime.ledger, the same code for both):\n")
    print("| field | ES | GRPO |")
    print("|---|---|---|")
    for key in FIELDS:
        if key != "actors":
            print(f"| {key} | {_cell(ledgers['es'][key])} | {_cell(ledgers['grpo'][key])} |")
    print(json.dumps({m: {k: led[k] for k in FIELDS if k != "actors"} for m, led in ledgers.items()}))


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, dict):
        return ", ".join(f"{k} {_cell(x)}" for k, x in v.items())
    return str(v)


if __name__ == "__main__":
    main()
