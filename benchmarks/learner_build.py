"""A GRPO learner rank's build and resume peaks (host RSS), side by side, beside the memory plan's build lines.

    python benchmarks/learner_build.py                  # SmolLM2-135M (the embedded model), grpo.fsdp_size=2, CPU
    python benchmarks/learner_build.py --fsdp-size 1    # the one-process learner (from_pretrained, whole fp32)

Each rank is a process of its own (gloo over 127.0.0.1). Build: its resident set just before ``join`` (torch,
transformers and the learner object loaded, nothing of the model), then the kernel's high-water mark (VmHWM, reset
through /proc/self/clear_refs) after ``join`` built and loaded the shards. On a CPU rank the plan's device and host
build lines are both in this process's memory, so the measured rise stands against their sum. Resume: a first set of
ranks builds and saves a checkpoint; a second set, fresh processes as a resumed run has, builds (the build figures
come from these) and then, its high-water mark reset, ``load``s the checkpoint into the built learner; the rise less
AdamW's state it creates (which stays: on the device on a GPU) stands against the plan's
"learner resume (host)" line. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# torch and the modules under test are imported in the functions that run them: --help needs none of them.

MiB = 1 << 20


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def rank_main(rank: int, world: int, address: str, model: str, checkpoint: str, queue) -> None:
    import accelerate  # noqa: F401  what the build imports, loaded before the measurement starts
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401

    from es_ray.grpo.config import to_grpo_config
    from es_ray.grpo.learner import GRPOLearner

    cfg = to_grpo_config(
        {
            "model": {"path": model},
            "engine": {"threads": 1, "device": "cpu"},
            "grpo": {"fsdp_size": world, "micro_batch_size": 2 * world, "prompts_per_step": world, "group_size": 2},
        }
    )
    learner = GRPOLearner(cfg, rank, world) if world > 1 else None
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status("VmRSS")
    if learner is None:
        learner = GRPOLearner(cfg, 0, 1)  # builds in the constructor
    else:
        learner.join(address)
    built = {"rss_before": before, "hwm_after": _status("VmHWM"), "rss_after": _status("VmRSS")}
    if not Path(checkpoint).exists():  # the first set of ranks writes the checkpoint the second set resumes
        learner.save(checkpoint, {"step": 0})
        queue.put({"rank": rank, **built})
        return
    Path("/proc/self/clear_refs").write_text("5")
    before = _status("VmRSS")
    learner.load(checkpoint)
    from es_ray.grpo.shards import local

    # AdamW's moments come into being at the resume and stay (on the device on a GPU): not the resume's transient
    state = sum(local(t).nbytes for st in learner.optimizer.state.values() for t in st.values() if hasattr(t, "nbytes"))
    queue.put(
        {
            "rank": rank,
            **built,
            "resume_rss_before": before,
            "resume_hwm_after": _status("VmHWM"),
            "resume_optimizer_state": state,
        }
    )


def _ranks(world: int, model: str, checkpoint: str) -> list[dict]:
    """One process per rank (a fresh port each time), their answers by rank."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, world, address, model, checkpoint, queue)) for r in range(world)]
    for p in procs:
        p.start()
    ranks = sorted((queue.get(timeout=900) for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join()
    return ranks


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
    with tempfile.TemporaryDirectory(prefix="learner_build_") as tmp:
        _ranks(args.fsdp_size, model, f"{tmp}/step_0")  # build and save
        ranks = _ranks(args.fsdp_size, model, f"{tmp}/step_0")  # fresh processes: build, then resume
    rise = max(r["hwm_after"] - r["rss_before"] for r in ranks)
    resume_rise = max(r["resume_hwm_after"] - r["resume_rss_before"] - r["resume_optimizer_state"] for r in ranks)
    resume_plan = planned.pop("learner resume (host)", 0)
    plan_bytes = sum(planned.values())
    out = {
        "model": shape.name,
        "parameters": shape.parameters(),
        "fsdp_size": args.fsdp_size,
        "whole_fp32_mib": round(shape.parameters() * 4 / MiB, 1),
        "planned_build_mib": {k: round(v / MiB, 1) for k, v in planned.items()},
        "planned_build_total_mib": round(plan_bytes / MiB, 1),
        "measured_build_peak_rise_mib": round(rise / MiB, 1),
        "measured_over_planned": round(rise / plan_bytes, 3),
        "planned_resume_host_mib": round(resume_plan / MiB, 1),
        "measured_resume_peak_rise_mib": round(resume_rise / MiB, 1),
        "resume_over_build": round(resume_rise / max(rise, 1), 3),
        "ranks": [{k: (round(v / MiB, 1) if k != "rank" else v) for k, v in r.items()} for r in ranks],
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
