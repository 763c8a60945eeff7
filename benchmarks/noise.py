"""Cost of one member's noise for every tensor of a model, per noise source, side by side in one run.

    python benchmarks/noise.py                        # the embedded SmolLM2-135M, 5 repeats, torch's threads
    python benchmarks/noise.py --threads 1 --repeats 7 --model /abs/hf/dir

For each source (es.noise=per_tensor, table, counter) it draws the noise of every tensor in the model's
safetensors (HF names and shapes, nothing loaded) the way a replica does (into one reused fp32 buffer; table hands
out views), and prints the median and fastest seconds of a full pass over the repeats, the ratio of the medians
to per_tensor, the median of the same pass followed by master + sigma * eps into a buffer (what a perturbation
writes, so table's views are charged for being read), and the one-time setup (table: drawing the table; counter:
building its lookup tables). counter is measured twice, side by side: eager (the reference) and compiled
(``es_ray.noise.compiled_block``, torch.compile's C++ on this CPU; its setup includes the compile, paid once per
process), with the ratio of their medians and the CPU's model. The last line is one JSON object with the same
numbers. CPU only: a GPU's costs are not measured here (scripts/gpu_smoke.py times nothing of noise).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from pathlib import Path

from es_ray.models import resolve_model

# torch and the modules under test are imported in the functions that run them: --help needs none of them.

KINDS = ("per_tensor", "table", "counter", "counter_compiled")
"""es.noise kinds; counter_compiled is counter with ES_RAY_NOISE_COMPILE=1 (the same numbers, compiled)."""


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def tensor_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """HF name -> shape from the safetensors headers (no tensor is read)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def measure(kind: str, shapes: dict[str, tuple[int, ...]], repeats: int, seed: int) -> dict:
    import torch

    from es_ray.noise import NoiseSource, counter_noise

    from es_ray import noise as noise_module

    os.environ[noise_module.COMPILE_ENV] = "1" if kind == "counter_compiled" else "0"
    kind = kind.removesuffix("_compiled")
    t0 = time.perf_counter()
    src = NoiseSource(seed, kind, table_size=1 << 25)
    if kind == "counter":  # its lookup tables are built once per process, on first use; the compile too
        counter_noise(0, 0, torch.empty(max(math.prod(s) for s in shapes.values())))
    setup = time.perf_counter() - t0
    failed = noise_module._COMPILE_FAILED.get("cpu")
    largest = max(math.prod(s) for s in shapes.values())
    buf, master, written = (torch.zeros(largest, dtype=torch.float32) for _ in range(3))

    def one_pass(r: int, add: bool) -> float:
        t0 = time.perf_counter()
        for name, shape in shapes.items():
            n = math.prod(shape)
            eps = src.noise(r, 0, name, torch.Size(shape), out=None if src.views else buf[:n].view(shape))
            if add:
                torch.add(master[:n].view(shape), eps, alpha=1e-3, out=written[:n].view(shape))
        return time.perf_counter() - t0

    noise = [one_pass(r, False) for r in range(repeats)]
    perturb = [one_pass(r, True) for r in range(repeats)]
    row = {
        "kind": kind + ("_compiled" if os.environ[noise_module.COMPILE_ENV] == "1" else ""),
        "median_s": statistics.median(noise),
        "min_s": min(noise),
        "with_add_s": statistics.median(perturb),
        "setup_s": setup,
    }
    if os.environ[noise_module.COMPILE_ENV] == "1" and failed:
        row["kind"] += f" (eager: compile failed, {failed})"
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="model.path (empty: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = tensor_shapes(resolve_model(args.model))
    numel = sum(math.prod(s) for s in shapes.values())
    rows = [measure(kind, shapes, args.repeats, args.seed) for kind in KINDS]
    base = rows[0]["median_s"]
    cpu = cpu_model()
    print(
        f"{len(shapes)} tensors, {numel / 1e6:.1f}M values, {torch.get_num_threads()} thread(s), "
        f"{args.repeats} repeats, CPU {cpu} ({torch.backends.cpu.get_cpu_capability()})"
    )
    print(f"{'noise':<18}{'median s':>10}{'min s':>9}{'x per_tensor':>14}{'+ add s':>9}{'setup s':>9}")
    for r in rows:
        r["ratio"] = r["median_s"] / base
        print(
            f"{r['kind']:<18}{r['median_s']:>10.3f}{r['min_s']:>9.3f}{r['ratio']:>14.2f}{r['with_add_s']:>9.3f}"
            f"{r['setup_s']:>9.2f}"
        )
    eager, compiled = rows[KINDS.index("counter")], rows[KINDS.index("counter_compiled")]
    speedup = eager["median_s"] / compiled["median_s"]
    print(
        f"counter eager {eager['median_s']:.3f} s vs compiled {compiled['median_s']:.3f} s a pass (medians): "
        f"{speedup:.2f}x; the compile {compiled['setup_s'] - eager['setup_s']:.1f} s once per process"
    )
    print(
        json.dumps(
            {
                "tensors": len(shapes),
                "values": numel,
                "threads": torch.get_num_threads(),
                "cpu": cpu,
                "repeats": args.repeats,
                "counter_compiled_speedup": round(speedup, 3),
                **{r["kind"]: {k: round(v, 4) for k, v in r.items() if k != "kind"} for r in rows},
            }
        )
    )


if __name__ == "__main__":
    main()
