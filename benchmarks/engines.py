"""The transformers and vLLM engines side by side on SmolLM2-135M-Instruct, in one run.

    python benchmarks/engines.py                          # both engines, bf16 and fp32, batches 16 and 64
    python benchmarks/engines.py --repeats 5 --engines vllm --dtypes float32

Per engine and dtype, each in a fresh subprocess (vLLM keeps process-global state; a fresh process also gives
each engine the same clean memory). vLLM runs with engine.enforce_eager=true: it starts in ~11 s instead of
~90 s, for ~10% less throughput at batch 16 and ~4% at 64 than its compiled default (measured separately).

* generation tokens/s at each batch size: arithmetic prompts with the chat template, 64 new tokens sampled at
  temperature 1 (the same seeds for both engines); a short warm-up call, then the median of ``--repeats`` calls;
* seconds per weight write: ``restore`` (write cast(master), no noise) and ``perturb`` (table noise + add +
  write), medians over ``--repeats`` calls;
* for ``--es-dtype`` (the CPU default, fp32): the share of an ES iteration spent outside generation, from the
  actor's own work (es_ray.es.worker.ESWorker in-process, no Ray) with the default ES configuration (population 8,
  16 prompts, 16 new tokens, table noise on CPU), ``--iterations`` iterations after a warm-up one. ES overhead
  = perturb + restore + update (noise, optimizer, writes, checksum); "outside gen" also counts the reward.

Medians are printed per engine, then the vLLM / transformers ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time

from es_ray.core.config import ClusterConfig, EngineConfig, RunConfig, SamplingConfig, TaskConfig
from es_ray.models import resolve_model
from es_ray.tasks import load_task

# torch, the engines and the ES modules are imported in measure(), after torch's thread count is set.

NEW_TOKENS = 64


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(
    engine_name: str, dtype: str, batches: list[int], repeats: int, iterations: int, threads: int, with_es: bool
) -> dict:
    """Runs in the child process: everything for one (engine, dtype)."""
    import torch

    torch.set_num_threads(threads)
    from es_ray.es.config import ESConfig
    from es_ray.es.config import ESTrainConfig, replica_spec, validate
    from es_ray.engines.base import make_engine
    from es_ray.es.protocol import EvalRequest, UpdateRequest
    from es_ray.strategy import ask, shape_fitness
    from es_ray.es.worker import ESWorker

    out: dict = {"engine": engine_name, "dtype": dtype}
    model_dir = str(resolve_model(""))
    task = load_task(TaskConfig(name="arithmetic", train_size=max(batches)))
    t0 = time.perf_counter()
    engine_cfg = EngineConfig(name=engine_name, dtype=dtype, device="cpu", threads=threads, enforce_eager=True)
    engine = make_engine(model_dir, engine_cfg)
    out["load_s"] = time.perf_counter() - t0
    prompts = [engine.apply_chat_template(task.messages(p)) for p in task.train]
    sampling = SamplingConfig(max_new_tokens=NEW_TOKENS, temperature=1.0, top_p=1.0)
    for batch in batches:
        engine.generate(prompts[:batch], dataclasses.replace(sampling, max_new_tokens=4), seed=0)  # warm-up
        rates = []
        for r in range(repeats):
            t0 = time.perf_counter()
            done = engine.generate(prompts[:batch], sampling, seed=r + 1)
            rates.append(sum(c.num_tokens for c in done) / (time.perf_counter() - t0))
        out[f"tok_s/b{batch}"] = statistics.median(rates)

    host = engine.replica_host()
    host.setup(dataclasses.replace(replica_spec(ESTrainConfig()), run_seed=0, noise="table"))
    host.perturb(0, 0, 1, 1e-3)
    out["write_s/restore"] = _median_time(host.restore, repeats)
    out["write_s/perturb"] = _median_time(lambda: host.perturb(0, 1, 1, 1e-3), repeats)
    host.restore()
    engine.close()
    del engine
    if not with_es:
        return out

    # One ES actor's iteration, in-process: the same calls the driver makes through Ray.
    cfg = validate(
        ESTrainConfig(
            engine=engine_cfg,
            es=ESConfig(),
            cluster=ClusterConfig(num_actors=1, cpus_per_actor=threads),
            run=RunConfig(dir="/tmp", seed=0),
        )
    )
    worker = ESWorker(cfg)
    rows = []
    for t in range(iterations + 1):
        members = ask(cfg.es.population, cfg.es.estimator)
        ids = tuple(range(min(cfg.es.prompts_per_iteration, len(worker.task.train))))
        t0 = time.perf_counter()
        res = worker.evaluate(EvalRequest(t, cfg.es.sigma, tuple(members), ids, sample_seed=t))
        fitness = shape_fitness([m.reward for m in res.members], cfg.es.shaping)
        upd = worker.update(UpdateRequest(t, cfg.es.sigma, tuple(members), tuple(map(float, fitness)), True))
        wall = time.perf_counter() - t0
        if t:  # the first iteration warms up
            rows.append({**res.timing_s, "update": upd.seconds, "iteration": wall})
    for key in ("iteration", "generate", "reward", "perturb", "restore", "update"):
        out[f"es_s/{key}"] = statistics.median(r[key] for r in rows)
    out["es/overhead_share"] = statistics.median(
        (r["perturb"] + r["restore"] + r["update"]) / r["iteration"] for r in rows
    )
    out["es/outside_generation_share"] = statistics.median(1 - r["generate"] / r["iteration"] for r in rows)
    worker.engine.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", nargs="+", default=["hf", "vllm"])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--batches", nargs="+", type=int, default=[16, 64])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--iterations", type=int, default=3, help="ES iterations measured (after one warm-up)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--es-dtype", default="float32", help="dtype of the ES-iteration measurement (CPU default)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.iterations < 1 or args.repeats < 1:
        ap.error("--iterations and --repeats must be >= 1 (medians need at least one measurement)")
    if args.child:
        engine_name, dtype = args.child.split(":")
        res = measure(
            engine_name, dtype, args.batches, args.repeats, args.iterations, args.threads, dtype == args.es_dtype
        )
        print("RESULT " + json.dumps(res), flush=True)
        return

    results = []
    for dtype in args.dtypes:
        for engine_name in args.engines:
            cmd = [
                sys.executable,
                __file__,
                "--child",
                f"{engine_name}:{dtype}",
                "--repeats",
                str(args.repeats),
                "--iterations",
                str(args.iterations),
                "--threads",
                str(args.threads),
                "--es-dtype",
                args.es_dtype,
                "--batches",
                *map(str, args.batches),
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode or not line:
                sys.exit(f"{engine_name} {dtype} failed:\n{proc.stderr[-4000:]}")
            results.append(json.loads(line[-1][len("RESULT ") :]))
            print(f"done {engine_name} {dtype}", file=sys.stderr, flush=True)
    report(results, args.batches)


def report(results: list[dict], batches: list[int]) -> None:
    cols = [f"tok/s b{b}" for b in batches] + [
        "restore s",
        "perturb s",
        "ES iter s",
        "gen s",
        "ES ovh",
        "outside gen",
        "load s",
    ]
    print(f"{'engine':<7}{'dtype':<10}" + "".join(f"{c:>12}" for c in cols))
    for r in results:
        es = "es_s/iteration" in r
        vals = (
            [f"{r[f'tok_s/b{b}']:.1f}" for b in batches]
            + [f"{r['write_s/restore']:.3f}", f"{r['write_s/perturb']:.3f}"]
            + (
                [
                    f"{r['es_s/iteration']:.2f}",
                    f"{r['es_s/generate']:.2f}",
                    f"{r['es/overhead_share']:.1%}",
                    f"{r['es/outside_generation_share']:.1%}",
                ]
                if es
                else ["-"] * 4
            )
            + [f"{r['load_s']:.1f}"]
        )
        print(f"{r['engine']:<7}{r['dtype']:<10}" + "".join(f"{v:>12}" for v in vals))
    by = {(r["engine"], r["dtype"]): r for r in results}
    for dtype in sorted({r["dtype"] for r in results}):
        hf, vl = by.get(("hf", dtype)), by.get(("vllm", dtype))
        if hf and vl:
            ratios = ", ".join(f"b{b} {vl[f'tok_s/b{b}'] / hf[f'tok_s/b{b}']:.2f}x" for b in batches)
            es = (
                f"; ES iteration time hf / vllm: {hf['es_s/iteration'] / vl['es_s/iteration']:.2f}x"
                if "es_s/iteration" in hf and "es_s/iteration" in vl
                else ""
            )
            print(
                f"vllm / hf tokens/s, {dtype}: {ratios}; restore write hf / vllm: "
                f"{hf['write_s/restore'] / vl['write_s/restore']:.2f}x{es}"
            )
    print("targets (2-core CPU): vllm >= 2x hf at b64 bfloat16; ES overhead < 10% of an iteration on vllm")


if __name__ == "__main__":
    main()
