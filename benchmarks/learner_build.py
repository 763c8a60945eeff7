"""A sharded GRPO learner rank's build peak (host RSS) beside the memory plan's build lines.

    python benchmarks/learner_build.py                  # SmolLM2-135M (the embedded model), grpo.fsdp_size=2, CPU
    python benchmarks/learner_build.py --fsdp-size 1    # the one-process learner (from_pretrained, whole fp32)

Each rank is a process of its own (gloo over 127.0.0.1): its resident set just before ``join`` (torch, transformers
and the learner object loaded, nothing of the model), then the kernel's high-water mark (VmHWM, reset through
/proc/self/clear_refs) after ``join`` built and loaded the shards. On a CPU rank the plan's device and host build
lines are both in this process's memory, so the measured rise stands against their sum. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MiB = 1 << 20


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def rank_main(rank: int, world: int, address: str, model: str, queue) -> None:
    import accelerate  # noqa: F401  what the build imports, loaded before the measurement starts
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401

    from es_ray.grpo.config import to_grpo_config
    from es_ray.grpo.learner import GRPOLearner

    cfg = to_grpo_config({"model": {"path": model}, "engine": {"threads": 1, "device": "cpu"},
                          "grpo": {"fsdp_size": world, "micro_batch_size": 2 * world, "prompts_per_step": world,
                                   "group_size": 2}})
    learner = GRPOLearner(cfg, rank, world) if world > 1 else None
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status("VmRSS")
    if learner is None:
        learner = GRPOLearner(cfg, 0, 1)  # builds in the constructor
    else:
        learner.join(address)
    queue.put({"rank": rank, "rss_before": before, "hwm_after": _status("VmHWM"), "rss_after": _status("VmRSS")})


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fsdp-size", type=int, default=2)
    ap.add_argument("--model", default="", help="model.path (default: the embedded SmolLM2-135M)")
    args = ap.parse_args(argv)
    from es_ray.memory_plan import ModelShape, Settings, plan_grpo
    from es_ray.models import resolve_model

    model = str(resolve_model(args.model))
    shape = ModelShape.from_hf_config(json.loads((Path(model) / "config.json").read_text()), name=Path(model).name)
    plan = plan_grpo(shape, Settings(fsdp_size=args.fsdp_size))
    planned = {line.item: line.nbytes for line in plan.lines if line.part == "build"}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, args.fsdp_size, address, model, queue))
             for r in range(args.fsdp_size)]
    for p in procs:
        p.start()
    ranks = sorted((queue.get(timeout=600) for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join()
    rise = max(r["hwm_after"] - r["rss_before"] for r in ranks)
    plan_bytes = sum(planned.values())
    out = {"model": shape.name, "parameters": shape.parameters(), "fsdp_size": args.fsdp_size,
           "whole_fp32_mib": round(shape.parameters() * 4 / MiB, 1),
           "planned_build_mib": {k: round(v / MiB, 1) for k, v in planned.items()},
           "planned_build_total_mib": round(plan_bytes / MiB, 1),
           "measured_build_peak_rise_mib": round(rise / MiB, 1),
           "measured_over_planned": round(rise / plan_bytes, 3),
           "ranks": [{k: (round(v / MiB, 1) if k != "rank" else v) for k, v in r.items()} for r in ranks]}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
