"""Peak host RAM of ES setup and of an ES checkpoint, per engine, on SmolLM2-135M (or any HF directory).

Each engine runs in a fresh subprocess that measures its own resident set in four phases: building the engine; the
master's loader alone (``iter_hf_weights``, each tensor cast to fp32 and dropped: what loading a master that lives on
a GPU costs the host); ``ReplicaHost.setup`` (the fp32 master loaded from the checkpoint and written into the
engine); one ES checkpoint (``state_dict`` + ``save_es_checkpoint``). The model is first copied with its tensors in
``--disk-dtype`` (bf16, as released models are stored). Before each phase the process's high-water mark is reset
(``/proc/self/clear_refs``), so a phase's peak is its own. Reported per phase, in MiB: ``kept`` = RSS after - RSS
before (what the phase leaves resident: on CPU the master itself) and ``transient`` = peak - RSS after (what it
needed only while it ran: the copies a GPU machine's host RAM pays too, since its master lives on the GPU).

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

    from es_ray.checkpoint import save_es_checkpoint
    from es_ray.config import to_train_config
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
        result["checkpoint"] = _phase(lambda: save_es_checkpoint(Path(tmp) / "ckpt", host.state_dict(), model_dir,
                                                                 {"iteration": 0}))
    result["master_mib"] = sum(t.numel() * 4 for t in host.state_dict()["master"].values()) / MIB
    held["engine"].close()
    return result


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
        for phase in ("engine_build", "master_load", "es_setup", "checkpoint"):
            p = r[phase]
            print(f"| {r['engine']} | {phase} | {p['kept_mib']:.0f} | {p['transient_mib']:.0f} | "
                  f"{p['peak_over_start_mib']:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
