"""Peak host RAM of ES setup and of an ES checkpoint, per engine, on SmolLM2-135M (or any HF directory).

Each engine runs in a fresh subprocess that measures its own resident set in six phases: building the engine; the
master's loader alone (``iter_hf_weights``, each tensor cast to fp32 and dropped: what loading a master that lives on
a GPU costs the host); ``ReplicaHost.setup`` (the fp32 master loaded from the checkpoint and written into the
engine); one ES checkpoint (``state_dict`` + ``save_es_checkpoint``: weights streamed tensor by tensor, digests);
resume (``load_es_state``: verified, then read tensor by tensor into the replica) beside the previous resume path
(``resume_whole``: the whole master read into one dict first). The save and resume peaks are then projected to a
7B model (``--project``, a memory-plan preset) in proportion to the master and to the largest tensor. The model is
first copied with its tensors in ``--disk-dtype`` (bf16, as released models are stored). Before each phase the
process's high-water mark is reset (``/proc/self/clear_refs``), so a phase's peak is its own. Reported per phase,
in MiB: ``kept`` = RSS after - RSS before (what the phase leaves resident: on CPU the master itself) and
``transient`` = peak - RSS after (what it needed only while it ran: the copies a GPU machine's host RAM pays too,
since its master lives on the GPU).

    python benchmarks/host_memory.py                         # both engines, SmolLM2-135M, fp32
    python benchmarks/host_memory.py --engines hf --model /abs/hf/dir --json out.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

MIB = 1 << 20


def _status() -> dict[str, int]:
    """VmRSS and VmHWM of this process in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _trim() -> None:
    """Hand freed heap back to the OS, so that RSS is what is alive, not what glibc keeps for later."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _phase(fn) -> dict[str, float]:
    _trim()
    Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark to the current RSS
    before = _status()["VmRSS"]
    fn()
    peak = _status()["VmHWM"]
    _trim()
    after = _status()["VmRSS"]
    return {"kept_mib": (after - before) / MIB, "transient_mib": (peak - after) / MIB,
            "peak_over_start_mib": (peak - before) / MIB}


def child(engine_name: str, model: str, dtype: str) -> dict:
    """One engine in this process: the three phases, measured."""
    import torch

    from es_ray.es.state import load_es_state, save_es_checkpoint
    from es_ray.es.config import to_train_config
    from es_ray.engines.base import make_engine
    from es_ray.models import iter_hf_weights, resolve_model
    from es_ray.replica import ReplicaSpec

    torch.set_num_threads(2)
    cfg = to_train_config({"model": {"path": model}, "engine": {"name": engine_name, "dtype": dtype,
                                                                  "device": "cpu", "enforce_eager": True}})
    model_dir = str(resolve_model(cfg.model.path))
    held: dict = {}
    result = {"engine": engine_name, "dtype": dtype, "model": model_dir, "start_rss_mib": _status()["VmRSS"] / MIB}
    result["engine_build"] = _phase(lambda: held.setdefault("engine", make_engine(model_dir, cfg.engine)))
    host = held["engine"].replica_host()

    def master_load() -> None:  # the master's loader alone, each tensor cast and dropped: a GPU replica's host cost
        for _, t in iter_hf_weights(model_dir):
            t.to(torch.float32)

    result["master_load"] = _phase(master_load)
    result["es_setup"] = _phase(lambda: host.setup(ReplicaSpec.from_config(cfg)))
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        result["checkpoint"] = _phase(lambda: save_es_checkpoint(ckpt, host.state_dict(), model_dir,
                                                                 {"iteration": 0}))
        # resume / rebuild: the checkpoint verified, then read tensor by tensor into the replica ...
        result["resume"] = _phase(lambda: host.load_state_dict(load_es_state(ckpt)))
        # ... and the previous path, side by side: every tensor read into one dict first, then loaded
        result["resume_whole"] = _phase(lambda: host.load_state_dict(_whole_state(ckpt)))
    master = host.state_dict()["master"]
    result["master_mib"] = sum(t.numel() * 4 for t in master.values()) / MIB
    result["largest_mib"] = max(t.numel() * 4 for t in master.values()) / MIB
    held["engine"].close()
    return result


def _whole_state(ckpt: Path) -> dict:
    """The resume path before tensor-by-tensor reads: the whole fp32 master in one dict (load_hf_weights)."""
    from es_ray.models import load_hf_weights

    master = load_hf_weights(ckpt)
    if "lm_head.weight" not in master and "model.embed_tokens.weight" in master:
        master["lm_head.weight"] = master["model.embed_tokens.weight"]
    return {"master": master, "optimizer": {"t": 0, "state": {}}, "theta0": None}


def projection(results: list[dict], target: str) -> str:
    """Each phase's peak over start, projected to the preset ``target`` (es_ray.memory_plan) two ways: in proportion
    to the fp32 master (a phase that holds the model) and to the largest tensor (a phase that streams)."""
    import math

    from es_ray.memory_plan import preset

    shape = preset(target)
    master = 4 * shape.parameters() / MIB
    largest = 4 * max(math.prod(s) for s in shape.tensors().values()) / MIB
    lines = [f"\nprojected to {target} (fp32 master {master / 1024:.1f} GiB, largest tensor {largest / 1024:.2f} GiB), "
             "GiB\n", "| engine | phase | measured MiB | x master | x largest tensor | 7B if it holds the model | "
             "7B if it streams |", "|---|---|---|---|---|---|---|"]
    for r in results:
        for phase in ("checkpoint", "resume", "resume_whole"):
            peak = r[phase]["peak_over_start_mib"]
            lines.append(f"| {r['engine']} | {phase} | {peak:.0f} | {peak / r['master_mib']:.2f} | "
                         f"{peak / r['largest_mib']:.2f} | {peak / r['master_mib'] * master / 1024:.1f} | "
                         f"{peak / r['largest_mib'] * largest / 1024:.1f} |")
    return "\n".join(lines)


ENGINE_PROCESS_GIB = 8.0
"""Host RAM the ES actor's processes hold besides checkpoint state (torch, CUDA context, vLLM, Ray worker): stated,
above the 2.7 GiB the vLLM CPU build measures here at 135M (engine_build)."""
GATHER_COPIES = 2
"""A checkpoint through vLLM on a GPU gathers the replica state from vLLM's worker process into the actor over
vLLM's message queue: the worker's CPU copy and the actor's copy are alive together (the in-process CPU engines
here measure no copy: the checkpoint phase above)."""


def es_actor_host_plan_gib(target: str, optimizer: str = "sgd", anchor_decay: bool = False) -> float:
    """Host RAM one ES actor on a GPU node needs at ``target`` (a memory-plan preset): the processes, plus the larger
    of a checkpoint (master, Adam's two moments, theta_0, GATHER_COPIES times) and a resume (one tensor at a time).
    launch/kuberay/rayjob.yaml and launch/cluster/*.yaml size their worker memory from it (tests check)."""
    import math

    from es_ray.memory_plan import preset

    shape = preset(target)
    master = 4 * shape.parameters()
    state = master * (1 + (2 if optimizer == "adam" else 0) + (1 if anchor_decay else 0))
    resume = 4 * max(math.prod(s) for s in shape.tensors().values())
    return ENGINE_PROCESS_GIB + max(GATHER_COPIES * state, resume) / (1 << 30)


def plan_table() -> str:
    from es_ray.memory_plan import PRESETS

    lines = ["\nhost RAM per ES actor on a GPU node (es_actor_host_plan_gib), GiB\n", "| model | sgd | adam |",
             "|---|---|---|"]
    lines += [f"| {name} | {es_actor_host_plan_gib(name):.1f} | {es_actor_host_plan_gib(name, 'adam'):.1f} |"
              for name in PRESETS]
    return "\n".join(lines)


def copy_in_dtype(model_dir: Path, dtype: str, out: Path) -> Path:
    """The model directory with its safetensors in ``dtype``: released checkpoints are bf16 on disk (the fp32 master is
    then a cast, made in memory), while the embedded SmolLM2 is converted to fp32 (which safetensors maps lazily)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.suffix == ".safetensors":
            save_file({k: v.to(getattr(torch, dtype)).contiguous() for k, v in load_file(f).items()}, out / f.name,
                      metadata={"format": "pt"})
        elif f.is_file():
            shutil.copy2(f, out / f.name)
    cfg = json.loads((out / "config.json").read_text())
    cfg["torch_dtype"] = cfg["dtype"] = dtype
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="model.path (empty: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--engines", default="hf,vllm")
    ap.add_argument("--dtype", default="float32", help="engine.dtype")
    ap.add_argument("--disk-dtype", default="bfloat16", help="dtype of the safetensors read (as released models)")
    ap.add_argument("--json", default="", help="also write the results here")
    ap.add_argument("--project", default="qwen2.5-7b", help="memory-plan preset the save and resume peaks are "
                    "projected to")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.model, args.dtype)), flush=True)
        return
    from es_ray.models import resolve_model

    tmp = tempfile.TemporaryDirectory()
    model = str(copy_in_dtype(resolve_model(args.model), args.disk_dtype, Path(tmp.name) / "model"))
    results = []
    for name in [e for e in args.engines.split(",") if e]:
        proc = subprocess.run([sys.executable, __file__, "--child", name, "--model", model, "--dtype", args.dtype],
                              capture_output=True, text=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if proc.returncode or line is None:
            raise SystemExit(f"{name}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
        results.append(json.loads(line[len("RESULT "):]))
    print(f"\nhost RSS per phase, MiB (model {args.model or 'SmolLM2-135M'} stored in {args.disk_dtype}, engine "
          f"{args.dtype}, fp32 master {results[0]['master_mib']:.0f} MiB)\n")
    print("| engine | phase | kept | transient | peak over start |")
    print("|---|---|---|---|---|")
    for r in results:
        for phase in ("engine_build", "master_load", "es_setup", "checkpoint", "resume", "resume_whole"):
            p = r[phase]
            print(f"| {r['engine']} | {phase} | {p['kept_mib']:.0f} | {p['transient_mib']:.0f} | "
                  f"{p['peak_over_start_mib']:.0f} |")
    print(projection(results, args.project))
    print(plan_table())
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
