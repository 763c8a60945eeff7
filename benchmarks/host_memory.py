"""Peak host RAM of ES setup, of an ES checkpoint and of a resume, per engine, on SmolLM2-135M (or any HF directory).

Each engine runs in a fresh subprocess (the ES actor) that measures its own resident set, and that of its child
processes (vLLM's tensor-parallel workers), in phases: building the engine; the master's loader alone
(``iter_hf_weights``, each tensor cast to fp32 and dropped: what loading a master that lives on a GPU costs the
host); ``ReplicaHost.setup``; one update (es.optimizer=adam by default, so the checkpoint holds two moments per
weight); one ES checkpoint as the actor writes it (``save_parts`` where the engine has it: each rank writes its own
part tensor by tensor, the export assembled one tensor at a time) beside the previous path
(``checkpoint_gathered``: the state gathered into the actor, then saved); resume (``load_es_state``: verified, then
read tensor by tensor, each rank reading its own part) beside the previous path (``resume_whole``: the whole master
read into one dict first; under tensor parallelism what was then saved to a file for the ranks). The save and
resume peaks of the actor are projected to a 7B model (``--project``, a memory-plan preset) in proportion to the
state and to the largest tensor. The model is first copied with its tensors in ``--disk-dtype`` (bf16, as released
models are stored). Before each phase the high-water marks are reset (``/proc/<pid>/clear_refs``), so a phase's
peak is its own. Reported per phase, in MiB: ``kept`` = RSS after - RSS before (what the phase leaves resident: on
CPU the master itself), ``transient`` = peak - RSS after (what it needed only while it ran: the copies a GPU
machine's host RAM pays too, since its master lives on the GPU), and the workers' peak over their start.

    python benchmarks/host_memory.py                         # hf, vllm, vllm with tensor_parallel_size=3
    python benchmarks/host_memory.py --engines hf --model /abs/hf/dir --json out.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

# Every other import stays in the function that measures with it: each child's resident set is what this benchmark
# reports, so a child imports only what its own engine needs.

MIB = 1 << 20


def _status(pid: str = "self") -> dict[str, int]:
    """VmRSS and VmHWM of a process in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _children() -> list[str]:
    """The pids of this process's descendants (vLLM's tensor-parallel workers)."""
    import os

    me, out = str(os.getpid()), []
    parents = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parents[d.name] = (d / "stat").read_text().rsplit(")", 1)[1].split()[1]
            except OSError:
                continue
    todo = [me]
    while todo:
        p = todo.pop()
        kids = [c for c, parent in parents.items() if parent == p]
        out += kids
        todo += kids
    return out


def _trim() -> None:
    """Hand freed heap back to the OS, so that RSS is what is alive, not what glibc keeps for later."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _phase(fn) -> dict[str, float]:
    _trim()
    kids = _children()
    for pid in ["self"] + kids:  # reset the high-water marks to the current RSS
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    before = _status()["VmRSS"]
    kids_before = sum(_status(pid)["VmRSS"] for pid in kids)
    fn()
    peak = _status()["VmHWM"]
    kids_peak = sum(_status(pid)["VmHWM"] for pid in kids)
    _trim()
    after = _status()["VmRSS"]
    return {
        "kept_mib": (after - before) / MIB,
        "transient_mib": (peak - after) / MIB,
        "peak_over_start_mib": (peak - before) / MIB,
        "workers_peak_over_start_mib": (kids_peak - kids_before) / MIB,
    }


def child(engine_name: str, model: str, dtype: str, tensor_parallel: int = 1, optimizer: str = "adam") -> dict:
    """One engine in this process: the phases, measured."""
    import torch

    from es_ray.es.state import load_es_state, save_es_checkpoint, save_es_checkpoint_parts
    from es_ray.es.config import replica_spec, to_train_config
    from es_ray.engines.base import make_engine
    from es_ray.models import iter_hf_weights, resolve_model
    from es_ray.strategy import ask, zscore

    torch.set_num_threads(1 if tensor_parallel > 1 else 2)
    cfg = to_train_config(
        {
            "model": {"path": model},
            "es": {"optimizer": optimizer},
            "engine": {
                "name": engine_name,
                "dtype": dtype,
                "device": "cpu",
                "enforce_eager": True,
                "tensor_parallel_size": tensor_parallel,
            },
        }
    )
    model_dir = str(resolve_model(cfg.model.path))
    held: dict = {}
    label = engine_name if tensor_parallel == 1 else f"{engine_name} tp={tensor_parallel}"
    result = {
        "engine": label,
        "dtype": dtype,
        "optimizer": optimizer,
        "model": model_dir,
        "start_rss_mib": _status()["VmRSS"] / MIB,
    }
    result["engine_build"] = _phase(lambda: held.setdefault("engine", make_engine(model_dir, cfg.engine)))
    host = held["engine"].replica_host()

    def master_load() -> None:  # the master's loader alone, each tensor cast and dropped: a GPU replica's host cost
        for _, t in iter_hf_weights(model_dir):
            t.to(torch.float32)

    result["master_load"] = _phase(master_load)
    result["es_setup"] = _phase(lambda: host.setup(replica_spec(cfg)))
    result["update"] = _phase(lambda: host.update(0, ask(4), list(zscore([0.1, 0.5, 0.2, 0.9])), 0.001))
    meta = {"iteration": 1}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        save_parts = getattr(host, "save_parts", None)  # as the ES actor saves (es_ray.es.worker)
        if save_parts is not None:
            result["checkpoint"] = _phase(lambda: save_es_checkpoint_parts(ckpt, save_parts, model_dir, meta))
        else:
            result["checkpoint"] = _phase(lambda: save_es_checkpoint(ckpt, host.state_dict(), model_dir, meta))
        # ... and the previous path, side by side: the state gathered into this process, then saved
        result["checkpoint_gathered"] = _phase(
            lambda: save_es_checkpoint(Path(tmp) / "gathered", host.state_dict(), model_dir, meta)
        )
        # resume / rebuild: the checkpoint verified, then read tensor by tensor into the replica ...
        result["resume"] = _phase(lambda: host.load_state_dict(load_es_state(ckpt)))
        # ... and the previous path, side by side: every tensor read into one dict first, then loaded
        result["resume_whole"] = _phase(lambda: host.load_state_dict(_whole_state(ckpt)))
    state = host.state_dict()
    sizes = [t.numel() * 4 for t in state["master"].values()]
    result["master_mib"] = sum(sizes) / MIB
    result["state_mib"] = (
        sum(sizes) + sum(t.numel() * 4 for m in state["optimizer"]["state"].values() for t in m.values())
    ) / MIB
    result["largest_mib"] = max(sizes) / MIB
    held["engine"].close()
    return result


def _whole_state(ckpt: Path) -> dict:
    """The resume path before tensor-by-tensor reads: the whole fp32 master and optimizer state in memory."""
    from es_ray.es.state import load_es_state
    from es_ray.models import load_hf_weights

    master = load_hf_weights(ckpt)
    if "lm_head.weight" not in master and "model.embed_tokens.weight" in master:
        master["lm_head.weight"] = master["model.embed_tokens.weight"]
    opt = load_es_state(ckpt)["optimizer"]
    return {
        "master": master,
        "optimizer": {
            "t": opt["t"],
            "state": {n: {k: v.clone() for k, v in m.items()} for n, m in opt["state"].items()},
        },
        "theta0": None,
    }


def projection(results: list[dict], target: str, optimizer: str) -> str:
    """The actor's save and resume peaks over start, projected to the preset ``target`` (es_ray.memory_plan) two
    ways: in proportion to the replica state (master and moments: a phase that holds the state) and to the largest
    tensor (a phase that streams)."""
    import math

    from es_ray.memory_plan import preset

    shape = preset(target)
    master = 4 * shape.parameters() / MIB
    state = master * (3 if optimizer == "adam" else 1)
    largest = 4 * max(math.prod(s) for s in shape.tensors().values()) / MIB
    lines = [
        f"\nthe ES actor's peak projected to {target} (fp32 master {master / 1024:.1f} GiB, {optimizer} state "
        f"{state / 1024:.1f} GiB, largest tensor {largest / 1024:.2f} GiB), GiB\n",
        "| engine | phase | measured MiB | x state | x largest tensor | 7B if it holds the state | 7B if it streams |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for phase in ("checkpoint", "checkpoint_gathered", "resume", "resume_whole"):
            peak = max(r[phase]["peak_over_start_mib"], 0.0)
            lines.append(
                f"| {r['engine']} | {phase} | {peak:.0f} | {peak / r['state_mib']:.2f} | "
                f"{peak / r['largest_mib']:.2f} | {peak / r['state_mib'] * state / 1024:.1f} | "
                f"{peak / r['largest_mib'] * largest / 1024:.1f} |"
            )
    return "\n".join(lines)


ENGINE_PROCESS_GIB = 8.0
"""Host RAM the ES actor's processes hold besides checkpoint state (torch, CUDA context, vLLM, Ray worker): stated,
above the 2.7 GiB the vLLM CPU build measures here at 135M (engine_build)."""
STREAM_COPIES = 2.5
"""Largest tensors alive at once in the actor while a checkpoint is written from the ranks' parts
(``save_es_checkpoint_parts``): the joined tensor, the parts read so far, and the file pages of the part being read
(safetensors copies out of a mapping): 2 + 1/TP, at most 2.5 at TP=2 (at TP=1 the one part is the tensor: 2);
measured 2.35 at TP=3. A resume holds one tensor, or a rank's part of it. The state itself is never held on the
host by a GPU replica."""


def es_actor_host_plan_gib(target: str) -> float:
    """Host RAM one ES actor on a GPU node needs at ``target`` (a memory-plan preset): the processes, plus
    STREAM_COPIES times the largest tensor (a checkpoint is written and read tensor by tensor, each tensor-parallel
    rank writing and reading its own part), whatever the optimizer: Adam's moments and theta_0 add files on disk,
    not host RAM. launch/kuberay/rayjob.yaml and launch/cluster/*.yaml size their worker memory from it (tests
    check)."""
    import math

    from es_ray.memory_plan import preset

    largest = 4 * max(math.prod(s) for s in preset(target).tensors().values())
    return ENGINE_PROCESS_GIB + STREAM_COPIES * largest / (1 << 30)


def plan_table() -> str:
    from es_ray.memory_plan import PRESETS

    lines = [
        "\nhost RAM per ES actor on a GPU node (es_actor_host_plan_gib, any optimizer), GiB\n",
        "| model | plan |",
        "|---|---|",
    ]
    lines += [f"| {name} | {es_actor_host_plan_gib(name):.1f} |" for name in PRESETS]
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
            save_file(
                {k: v.to(getattr(torch, dtype)).contiguous() for k, v in load_file(f).items()},
                out / f.name,
                metadata={"format": "pt"},
            )
        elif f.is_file():
            shutil.copy2(f, out / f.name)
    cfg = json.loads((out / "config.json").read_text())
    cfg["torch_dtype"] = cfg["dtype"] = dtype
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="model.path (empty: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument(
        "--engines",
        default="hf,vllm,vllm:3",
        help="engine.name[:tensor_parallel_size], comma-separated "
        "(SmolLM2-135M has 9 attention heads: tensor_parallel_size 3)",
    )
    ap.add_argument("--dtype", default="float32", help="engine.dtype")
    ap.add_argument("--optimizer", default="adam", help="es.optimizer")
    ap.add_argument("--disk-dtype", default="bfloat16", help="dtype of the safetensors read (as released models)")
    ap.add_argument("--json", default="", help="also write the results here")
    ap.add_argument(
        "--project", default="qwen2.5-7b", help="memory-plan preset the save and resume peaks are projected to"
    )
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        name, _, tp = args.child.partition(":")
        print("RESULT " + json.dumps(child(name, args.model, args.dtype, int(tp or 1), args.optimizer)), flush=True)
        return
    from es_ray.models import resolve_model

    tmp = tempfile.TemporaryDirectory()
    model = str(copy_in_dtype(resolve_model(args.model), args.disk_dtype, Path(tmp.name) / "model"))
    results = []
    for name in [e for e in args.engines.split(",") if e]:
        proc = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                name,
                "--model",
                model,
                "--dtype",
                args.dtype,
                "--optimizer",
                args.optimizer,
            ],
            capture_output=True,
            text=True,
        )
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if proc.returncode or line is None:
            raise SystemExit(f"{name}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
        results.append(json.loads(line[len("RESULT ") :]))
    print(
        f"\nhost RSS per phase, MiB (model {args.model or 'SmolLM2-135M'} stored in {args.disk_dtype}, engine "
        f"{args.dtype}, es.optimizer={args.optimizer}: fp32 master {results[0]['master_mib']:.0f} MiB, state "
        f"{results[0]['state_mib']:.0f} MiB, largest tensor {results[0]['largest_mib']:.0f} MiB)\n"
    )
    print("| engine | phase | kept | transient | peak over start | workers' peak over start |")
    print("|---|---|---|---|---|---|")
    for r in results:
        for phase in (
            "engine_build",
            "master_load",
            "es_setup",
            "update",
            "checkpoint",
            "checkpoint_gathered",
            "resume",
            "resume_whole",
        ):
            p = r[phase]
            print(
                f"| {r['engine']} | {phase} | {p['kept_mib']:.0f} | {p['transient_mib']:.0f} | "
                f"{p['peak_over_start_mib']:.0f} | {p['workers_peak_over_start_mib']:.0f} |"
            )
    print(projection(results, args.project, args.optimizer))
    print(plan_table())
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
