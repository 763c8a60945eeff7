"""Population batching against its limit: full-rank and low-rank ES iterations next to one full-batch generation of
the same rows by the base model, per engine, in one run.

    python benchmarks/population.py                       # hf and vllm (where installed), 8 members x 16 prompts
    python benchmarks/population.py --engines hf --members 2 --prompts 2 --max-new-tokens 4 --repeats 1

The batch: N members (``--members``) x P prompts (``--prompts``) of the task ``arithmetic`` with the chat template,
greedy, ``--max-new-tokens`` new tokens, one actor's torch threads (``--threads``), engine.batch_size >= N x P.
Per engine and per es.perturbation, in a fresh subprocess (vLLM keeps process-global state; each phase also gets
the same clean memory), an ``es_ray.worker.ESWorker`` runs in-process (no Ray) and the script calls what the driver
calls through Ray: ``evaluate(EvalRequest)`` then ``update(UpdateRequest)`` with the shaped fitness and the
driver's checksum request, so the figures are the actor's own code path:

(a) the limit: the N x P rows (each prompt once per member, member-major) in one ``engine.generate`` call on the
    weights cast(master), restored first; tokens/s = generated tokens / seconds of the call;
(b) full: es.perturbation=full, an iteration = evaluate (per member: perturb, generate P, score; then restore) +
    update; tokens/s = generated tokens / seconds of the iteration;
(c) lowrank: es.perturbation=lowrank at rank ``--rank``, an iteration = evaluate (one batched ``generate_members``,
    score) + update.

Repeats are interleaved within each phase: a warm-up limit call and iteration, then ``--repeats`` times a limit call
and an iteration (iterations 1, 2, ...). Figures are medians over the repeats. vLLM runs with engine.enforce_eager
(starts in seconds on a CPU) unless ``--vllm-compiled``.

Keys of the JSON object on the last line, per engine E in hf, vllm (where it ran), M in full, lowrank:
  E_limit_tok_s                 (a): tokens/s of the limit call, measured in the full-rank phase (a plain engine)
  E_limit_s, E_limit_tokens     (a): seconds and generated tokens of one limit call
  E_limit_lowrank_engine_tok_s  the same call on the low-rank phase's engine, interleaved with (c): for hf the same
                                kind of engine (a check on drift between the phases); for vLLM the LoRA-enabled
                                engine serving no LoRA
  E_M_tok_s                     generated tokens of the iteration / seconds of the iteration
  E_M_share_of_limit            E_M_tok_s / E_limit_tok_s
  E_M_outside_generation        1 - generate seconds / iteration seconds (perturb + restore + scoring + update)
  E_M_iteration_s, E_M_generate_s, E_M_perturb_s, E_M_restore_s, E_M_reward_s, E_M_update_s
                                seconds per iteration, per phase (the actor's own timing; update includes the
                                checksum the driver asks for)
  E_M_tokens                    generated tokens per iteration (all members)
  E_M_target_met                true / false against the target below; absent where the pair has none
  E_M_error                     only when the phase failed: the last line of its error (its figures are absent)
Settings: model, engines, members, prompts, max_new_tokens, threads, rank, repeats, batch_size, vllm_enforce_eager.

Targets: hf lowrank >= 85% of the limit; hf full < 3% of the iteration outside generation; vllm full < 10%;
vllm lowrank is reported as measured (its target holds on a GPU only).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import time

PERTURBATIONS = ("full", "lowrank")
PHASES = ("iteration", "generate", "perturb", "restore", "reward", "update")
TARGETS = {("hf", "lowrank"): ("share_of_limit", ">=", 0.85, "of the limit"),
           ("hf", "full"): ("outside_generation", "<", 0.03, "of the iteration outside generation"),
           ("vllm", "full"): ("outside_generation", "<", 0.10, "of the iteration outside generation")}
"""(engine, perturbation) -> (figure, comparison, bound, words)."""


def batch_size(args) -> int:
    """engine.batch_size: the default, raised to N x P so that the limit is one batch (and so is hf's population)."""
    from es_ray.core.config import EngineConfig

    return max(EngineConfig.batch_size, args.members * args.prompts)


def build_config(args, engine_name: str, perturbation: str):
    from es_ray.config import ESConfig, ESTrainConfig, validate
    from es_ray.core.config import (ClusterConfig, EngineConfig, ModelConfig, RunConfig, SamplingConfig,
                                    TaskConfig)

    engine = EngineConfig(name=engine_name, threads=args.threads, batch_size=batch_size(args),
                          enforce_eager=not args.vllm_compiled)
    return validate(ESTrainConfig(
        model=ModelConfig(path=args.model), task=TaskConfig(name="arithmetic", train_size=args.prompts),
        es=ESConfig(population=args.members, prompts_per_iteration=args.prompts, perturbation=perturbation,
                    rank=args.rank),
        sampling=SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=0.0),
        engine=engine, cluster=ClusterConfig(num_actors=1, cpus_per_actor=args.threads),
        run=RunConfig(dir="/tmp", seed=0, trackers=[], progress=False)))


def measure(args, engine_name: str, perturbation: str) -> dict:
    """Runs in the child process: one ESWorker, the limit calls and the ES iterations, interleaved."""
    from es_ray.protocol import EvalRequest, UpdateRequest
    from es_ray.strategy import ask, shape_fitness
    from es_ray.tasks.base import templated_prompts
    from es_ray.worker import ESWorker

    cfg = build_config(args, engine_name, perturbation)
    worker = ESWorker(cfg)
    prompt_ids = tuple(range(cfg.es.prompts_per_iteration))
    train = templated_prompts(worker.engine, worker.task)["train"]
    rows = [train[i] for i in prompt_ids] * cfg.es.population  # member-major, as generate_members lays them out

    def limit() -> tuple[float, int]:
        worker.replica.restore()  # weights = cast(master); untimed
        t0 = time.perf_counter()
        done = worker.engine.generate(rows, cfg.sampling, seed=0)
        return time.perf_counter() - t0, sum(c.num_tokens for c in done)

    def iteration(t: int) -> dict:
        members = ask(cfg.es.population, cfg.es.estimator)
        every = cfg.es.checksum_every
        t0 = time.perf_counter()
        res = worker.evaluate(EvalRequest(t, cfg.es.sigma, tuple(members), prompt_ids, sample_seed=t))
        fitness_n = shape_fitness([m.reward for m in res.members], cfg.es.shaping)
        upd = worker.update(UpdateRequest(t, cfg.es.sigma, tuple(members), tuple(map(float, fitness_n)),
                                          bool(every) and (t + 1) % every == 0))
        wall = time.perf_counter() - t0
        return {**res.timing_s, "update": upd.seconds, "iteration": wall,
                "tokens": sum(m.tokens for m in res.members)}

    limit(), iteration(0)  # warm-up
    limits, iters = [], []
    for r in range(args.repeats):
        limits.append(limit())
        iters.append(iteration(r + 1))
    worker.engine.close()

    med = statistics.median
    out = {"limit_s": med(s for s, _ in limits), "limit_tokens": med(n for _, n in limits),
           "limit_tok_s": med(n / s for s, n in limits)}
    out.update({f"{k}_s": med(it.get(k, 0.0) for it in iters) for k in PHASES})
    out["tokens"] = med(it["tokens"] for it in iters)
    out["tok_s"] = med(it["tokens"] / it["iteration"] for it in iters)
    out["outside_generation"] = med(1 - it["generate"] / it["iteration"] for it in iters)
    return out


def run_phase(args, engine_name: str, perturbation: str) -> dict:
    """One (engine, perturbation) in a fresh subprocess: its figures, or {"error": the last line of its error}."""
    cmd = [sys.executable, __file__, "--child", f"{engine_name}:{perturbation}", "--model", args.model,
           "--members", str(args.members), "--prompts", str(args.prompts), "--max-new-tokens",
           str(args.max_new_tokens), "--threads", str(args.threads), "--rank", str(args.rank), "--repeats",
           str(args.repeats), *(["--vllm-compiled"] if args.vllm_compiled else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not line:
        print(f"{engine_name} {perturbation} failed:\n{proc.stderr[-3000:]}", file=sys.stderr, flush=True)
        last = [x for x in proc.stderr.strip().splitlines() if x.strip()]
        return {"error": last[-1] if last else f"exit status {proc.returncode}"}
    print(f"done {engine_name} {perturbation}", file=sys.stderr, flush=True)
    return json.loads(line[-1][len("RESULT "):])


def collect(engine_name: str, phases: dict[str, dict]) -> dict:
    """The JSON keys of one engine from its phases' figures."""
    out: dict = {}
    full, low = phases["full"], phases["lowrank"]
    if "limit_tok_s" in full:
        out.update({f"{engine_name}_limit_{k}": full[f"limit_{k}"] for k in ("tok_s", "s", "tokens")})
    if "limit_tok_s" in low:
        out[f"{engine_name}_limit_lowrank_engine_tok_s"] = low["limit_tok_s"]
    for mode, res in phases.items():
        key = f"{engine_name}_{mode}"
        if "error" in res:
            out[f"{key}_error"] = res["error"]
            continue
        out[f"{key}_tok_s"] = res["tok_s"]
        if f"{engine_name}_limit_tok_s" in out:
            out[f"{key}_share_of_limit"] = res["tok_s"] / out[f"{engine_name}_limit_tok_s"]
        out[f"{key}_outside_generation"] = res["outside_generation"]
        out.update({f"{key}_{k}_s": res[f"{k}_s"] for k in PHASES})
        out[f"{key}_tokens"] = res["tokens"]
        target = TARGETS.get((engine_name, mode))
        if target and f"{key}_{target[0]}" in out:
            value = out[f"{key}_{target[0]}"]
            out[f"{key}_target_met"] = value >= target[2] if target[1] == ">=" else value < target[2]
    return out


def report(figures: dict, engines: list[str]) -> None:
    cols = ["tok/s", "of limit", "iter s", "gen s", "perturb s", "restore s", "reward s", "update s", "outside gen"]
    print(f"{'engine':<7}{'mode':<9}" + "".join(f"{c:>12}" for c in cols))
    for e in engines:
        if f"{e}_limit_tok_s" in figures:
            vals = [f"{figures[f'{e}_limit_tok_s']:.1f}", "100.0%", f"{figures[f'{e}_limit_s']:.2f}"]
            print(f"{e:<7}{'limit':<9}" + "".join(f"{v:>12}" for v in vals + ["-"] * 6))
        for mode in PERTURBATIONS:
            key = f"{e}_{mode}"
            if f"{key}_error" in figures:
                print(f"{e:<7}{mode:<9}  failed: {figures[f'{key}_error']}")
                continue
            share = figures.get(f"{key}_share_of_limit")
            vals = [f"{figures[f'{key}_tok_s']:.1f}", f"{share:.1%}" if share is not None else "-"]
            vals += [f"{figures[f'{key}_{k}_s']:.3f}" for k in PHASES] + [f"{figures[f'{key}_outside_generation']:.1%}"]
            print(f"{e:<7}{mode:<9}" + "".join(f"{v:>12}" for v in vals))
        if f"{e}_limit_lowrank_engine_tok_s" in figures:
            print(f"{e}: the limit call on the low-rank phase's engine: "
                  f"{figures[f'{e}_limit_lowrank_engine_tok_s']:.1f} tok/s")
    print("targets:")
    for e in engines:
        for mode in PERTURBATIONS:
            key, target = f"{e}_{mode}", TARGETS.get((e, mode))
            if target is None:
                if f"{key}_tok_s" in figures:
                    print(f"  {e} {mode}: reported as measured ({figures.get(f'{key}_share_of_limit', 0):.1%} of the "
                          f"limit, {figures[f'{key}_outside_generation']:.1%} outside generation); its target holds "
                          "on a GPU only")
                continue
            figure, op, bound, words = target
            value = figures.get(f"{key}_{figure}")
            verdict = "n/a (not measured)" if value is None else (
                f"{value:.1%} -> {'PASS' if figures[f'{key}_target_met'] else 'FAIL'}")
            print(f"  {e} {mode}: {op} {bound:.0%} {words}: {verdict}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_engines = "hf,vllm" if importlib.util.find_spec("vllm") else "hf"
    ap.add_argument("--engines", default=default_engines, help=f"comma-separated (default here: {default_engines})")
    ap.add_argument("--model", default="", help="model.path: a local HF dir (empty: the embedded SmolLM2-135M)")
    ap.add_argument("--members", type=int, default=8, help="N, es.population (one actor holds them all)")
    ap.add_argument("--prompts", type=int, default=16, help="P, es.prompts_per_iteration")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (one demo actor has 1)")
    ap.add_argument("--rank", type=int, default=8, help="es.rank of the low-rank phase")
    ap.add_argument("--repeats", type=int, default=3, help="measured repeats (after a warm-up); medians")
    ap.add_argument("--vllm-compiled", action="store_true", help="vLLM without engine.enforce_eager")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if min(args.members, args.prompts, args.max_new_tokens, args.threads, args.repeats) < 1:
        ap.error("--members, --prompts, --max-new-tokens, --threads and --repeats must be >= 1")
    if args.members < 2:
        ap.error("--members must be >= 2 (es.population >= 2)")
    if args.child:
        engine_name, perturbation = args.child.split(":")
        print("RESULT " + json.dumps(measure(args, engine_name, perturbation)), flush=True)
        return

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    figures: dict = {}
    for e in engines:
        figures.update(collect(e, {mode: run_phase(args, e, mode) for mode in PERTURBATIONS}))
    report(figures, engines)
    settings = {"model": args.model, "engines": engines, "members": args.members, "prompts": args.prompts,
                "max_new_tokens": args.max_new_tokens, "threads": args.threads, "rank": args.rank,
                "repeats": args.repeats, "batch_size": batch_size(args),
                "vllm_enforce_eager": not args.vllm_compiled}
    print(json.dumps({**settings, **figures}))
    if any(k.endswith("_error") for k in figures):
        sys.exit(1)


if __name__ == "__main__":
    main()
