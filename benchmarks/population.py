"""Population batching against its limit: full-rank and low-rank ES iterations next to one full-batch generation of
the same rows by the base model, per engine, in one run.

    python benchmarks/population.py                       # hf and vllm (where installed), 8 members x 16 prompts
    python benchmarks/population.py --engines hf --members 2 --prompts 2 --max-new-tokens 4 --repeats 1

The batch: N members (``--members``) x P prompts (``--prompts``) of the task ``arithmetic`` with the chat template,
greedy, ``--max-new-tokens`` new tokens for every row (EOS suppressed, ``all_tokens``; ``--eos`` lets rows stop),
one actor's torch threads (``--threads``), engine.batch_size >= N x P.
Per engine and per es.perturbation, in a fresh subprocess (vLLM keeps process-global state; each phase also gets
the same clean memory), an ``es_ray.es.worker.ESWorker`` runs in-process (no Ray) and the script calls what the driver
calls through Ray: ``evaluate(EvalRequest)`` then ``update(UpdateRequest)`` with the shaped fitness and the
driver's checksum request, so the figures are the actor's own code path:

(a) the limit: the N x P rows (each prompt once per member, member-major) in one ``engine.generate`` call on the
    weights cast(master), restored first; tokens/s = generated tokens / seconds of the call;
(b) full: es.perturbation=full, an iteration = evaluate (per member: perturb, generate P, score; then restore) +
    update; tokens/s = generated tokens / seconds of the iteration;
(c) lowrank: es.perturbation=lowrank at rank ``--rank``, an iteration = evaluate (one batched ``generate_members``,
    score) + update;
(d) the low-rank reference, in the low-rank phase: the same ``generate_members`` call (the same rows, each
    prefilled, the members' factors drawn and laid out, the same kernels) on the base weights with the low-rank
    term switched off (``Engine.lowrank_term_off``: hf, each layer's term an output of zeros into which the base GEMM
    accumulates as it does into the term; vLLM, its LoRA kernel a no-op), so the share of it is the term's own cost.
    It is the same work minus the term only when both arms generate the same tokens: with EOS, the reference's
    members are all the base model, whose rows stop at other steps than the perturbed members' (greedy), and hf's
    generate still runs a stopped row every step until the call's last row stops, so the reference counted fewer
    tokens for the same steps and looked slower (shares of 103-111%: docs/population-batching.md). Hence EOS is
    suppressed in every arm by default, and with ``--eos`` the share is printed but not judged.

Repeats are interleaved within each phase: a warm-up limit call and iteration, then ``--repeats`` times a limit call
(the low-rank phase: and the reference) and an iteration (iterations 1, 2, ...), each repeat in the reverse order
of the one before (A B, B A), so a drift of the load hits every arm alike. Figures are medians over the repeats;
lowrank's shares of its reference are medians of the repeats' paired ratios (each against the reference run next
to it), with their lowest and highest.
vLLM runs with engine.enforce_eager (starts in seconds on a CPU) unless ``--vllm-compiled``.

Keys of the JSON object on the last line, per engine E in hf, vllm (where it ran), M in full, lowrank:
  E_limit_tok_s                 (a): tokens/s of the limit call, measured in the full-rank phase (a plain engine)
  E_limit_s, E_limit_tokens     (a): seconds and generated tokens of one limit call
  E_base_loop_tok_s             (d): tokens/s of the low-rank reference, interleaved with the lowrank iterations
  E_lowrank_share_of_base_loop  generated tokens / generate seconds of the lowrank iteration over E_base_loop_tok_s;
                                _iteration_share_of_base_loop the same with iteration seconds; _cpu_share_of_base_loop
                                (hf) with the calling thread's CPU seconds (evaluate vs the call), which other
                                processes on the cores inflate less (hf's target reads it); each with _range, its
                                lowest and highest repeat. The population does strictly more work than its
                                reference, so a share above 100% in more repeats than chance puts there (a sign
                                test, 12.5% false alarms: 3 of 3, 5 of 5, 7 of 9; share_verdict) is a defect of the
                                benchmark (a reference that is not the same work): E_lowrank_defect says so (on the
                                target's figure), and the target is not met; a median above 100% short of that is
                                within the noise (E_lowrank_above_within_noise)
  E_lowrank_same_work           every row of the iterations and of the reference generated --max-new-tokens tokens
                                (false with --eos: the share and the target are then not judged)
  E_lowrank_share_of_limit      beside it, labelled "shared prefill": the limit prefills a repeated prompt once,
                                which members under different weights cannot share, so it is no bound on them
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
  E_full_fixed_s, _fixed_share  full rank's fixed costs per iteration: perturb + restore + update (its checksum
                                included), and their share of the iteration
  E_full_checksum_s             one replica checksum (the driver asks for one each es.checksum_every iterations),
                                timed on its own after each iteration
  E_M_target_met                true / false against the target below; absent where the pair has none
  E_M_error                     only when the phase failed: the last line of its error (its figures are absent)
machine: CPU model, its matmul-relevant flags, cores, torch threads and version, the load average before the run
(1 minute) and at its end (1, 5, 15 minutes).
Settings: model, engines, members, prompts, max_new_tokens, threads, rank, repeats, batch_size, vllm_enforce_eager,
no_eos.

--profile (``profile``, ``profile_vllm``): where the low-rank generation's time goes beside the limit and the limit's
rows each prefilled; hf per layer kind, prefill and decode; vLLM split into the CPU LoRA kernel of
``vllm_extension`` and vLLM's own LoRA path; JSON: machine, settings, hf_profile, vllm_profile (per engine run).

Targets: hf lowrank >= 95% of its reference (d) in CPU seconds, at most 100% (above it in more repeats than chance
puts there, a benchmark defect); hf full's fixed costs < 3% of the iteration; vllm full < 10% of the iteration
outside generation; vllm lowrank is reported as measured (its target holds on a GPU only).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import time

from es_ray.core.config import ClusterConfig, EngineConfig, ModelConfig, RunConfig, SamplingConfig, TaskConfig
from es_ray.perturbation import PERTURBATIONS as MODES
from es_ray.tasks.base import templated_prompts

# torch, vLLM and the ES worker, config and strategy (numpy, torch) are imported in the functions that run in the
# measuring child process: the parent only starts children and prints their figures, and imports none of them.

PERTURBATIONS = ("full", "lowrank")
# the chance that the defect check flags a reference doing the same work (share_verdict's sign test)
DEFECT_FALSE_ALARM = 0.125
PHASES = ("iteration", "generate", "perturb", "restore", "reward", "update")
TARGETS = {
    ("hf", "lowrank"): (
        "cpu_share_of_base_loop",
        ">=",
        0.95,
        "of its reference (the same loop, the low-rank term switched off), CPU seconds",
    ),
    ("hf", "full"): ("fixed_share", "<", 0.03, "of the iteration in perturb + restore + update (checksum)"),
    ("vllm", "full"): ("outside_generation", "<", 0.10, "of the iteration outside generation"),
}
"""(engine, perturbation) -> (figure, comparison, bound, words)."""


def batch_size(args) -> int:
    """engine.batch_size: the default, raised to N x P so that the limit is one batch (and so is hf's population)."""
    return max(EngineConfig.batch_size, args.members * args.prompts)


def build_config(args, engine_name: str, perturbation: str):
    from es_ray.es.config import ESConfig, ESTrainConfig, validate

    engine = EngineConfig(
        name=engine_name, threads=args.threads, batch_size=batch_size(args), enforce_eager=not args.vllm_compiled
    )
    return validate(
        ESTrainConfig(
            model=ModelConfig(path=args.model),
            task=TaskConfig(name="arithmetic", train_size=args.prompts),
            es=ESConfig(
                population=args.members, prompts_per_iteration=args.prompts, perturbation=perturbation, rank=args.rank
            ),
            sampling=SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=0.0),
            engine=engine,
            cluster=ClusterConfig(num_actors=1, cpus_per_actor=args.threads),
            run=RunConfig(dir="/tmp", seed=0, trackers=[], progress=False),
        )
    )


def all_tokens(engine, max_new_tokens: int) -> None:
    """Every row generates ``max_new_tokens`` tokens, EOS never stops it (the default; ``--eos`` lets rows stop):
    hf, generation_config.min_new_tokens; vLLM, each request's ignore_eos and min_tokens. So two modes whose rows
    would stop at other steps (the base model and its perturbed members answer differently) run the same decode
    steps and generate the same tokens, and their tokens/s compare the same work. With EOS, hf's generate runs until
    the call's last row stops and a stopped row still costs every step, so a mode whose rows stop earlier (the
    term-off reference: all its members are the base model) counts fewer tokens for the same work and looks slower;
    vLLM drops a stopped request, so there the arms differ in the work itself."""
    if engine.name == "hf":
        engine.model.generation_config.min_new_tokens = max_new_tokens
        return
    sampling_params = engine._sampling_params

    def without_eos(*a, **kw):
        params = sampling_params(*a, **kw)
        for p in params:
            p.ignore_eos, p.min_tokens = True, max_new_tokens
        return params

    engine._sampling_params = without_eos


def each_row_generation(engine):
    """The limit's rows, each prefilled: the population's work on the base weights. The limit's rows repeat each
    prompt once per member; the engines prefill a repeated prompt once (hf: ``shared_prefill``; vLLM: its prefix
    cache, for requests scheduled after the prompt's first blocks were computed, and across calls on the same
    weights), which members under different weights cannot share: ``Engine.generate(share_prompts=False)`` (hf: no
    shared prefill; vLLM: each row its own prefix-cache salt)."""
    return lambda rows, sampling, seed: engine.generate(rows, sampling, seed, share_prompts=False)


def measure(args, engine_name: str, perturbation: str) -> dict:
    """Runs in the child process: one ESWorker, the limit calls and the ES iterations (and the low-rank reference),
    interleaved: each repeat runs the arms in the order of the one before reversed (A B, B A, ...), so a drift of the
    machine's load hits every arm alike."""
    from es_ray.es.protocol import EvalRequest, UpdateRequest
    from es_ray.strategy import ask, shape_fitness
    from es_ray.es.worker import ESWorker

    cfg = build_config(args, engine_name, perturbation)
    factored = MODES.get(perturbation).factored  # a low-rank term to switch off for the reference loop
    worker = ESWorker(cfg)
    if not args.eos:
        all_tokens(worker.engine, args.max_new_tokens)
    prompt_ids = tuple(range(cfg.es.prompts_per_iteration))
    train = templated_prompts(worker.engine, worker.task)["train"]
    rows = [train[i] for i in prompt_ids] * cfg.es.population  # member-major, as generate_members lays them out

    def limit() -> tuple[float, int, float]:
        worker.replica.restore()  # weights = cast(master); untimed
        t0, c0 = time.perf_counter(), time.thread_time()
        done = worker.engine.generate(rows, cfg.sampling, seed=0)
        return time.perf_counter() - t0, sum(c.num_tokens for c in done), time.thread_time() - c0

    def base_loop(t: int) -> tuple[float, int, float]:
        """(d): the iteration's own generation call, its members and seed, with the low-rank term off."""
        members = list(ask(cfg.es.population, cfg.es.estimator))
        prompts = [train[i] for i in prompt_ids]
        with worker.engine.lowrank_term_off():
            t0, c0 = time.perf_counter(), time.thread_time()
            done = worker.replica.generate_members(t, members, cfg.es.sigma, prompts, cfg.sampling, t)
            wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        return wall, sum(c.num_tokens for m in done for c in m), cpu

    def iteration(t: int) -> dict:
        members = ask(cfg.es.population, cfg.es.estimator)
        every = cfg.es.checksum_every
        t0, c0 = time.perf_counter(), time.thread_time()
        res = worker.evaluate(EvalRequest(t, cfg.es.sigma, tuple(members), prompt_ids, sample_seed=t))
        evaluate_cpu = time.thread_time() - c0
        fitness_n = shape_fitness([m.reward for m in res.members], cfg.es.shaping)
        upd = worker.update(
            UpdateRequest(
                t, cfg.es.sigma, tuple(members), tuple(map(float, fitness_n)), bool(every) and (t + 1) % every == 0
            )
        )
        wall = time.perf_counter() - t0
        c0 = time.perf_counter()
        worker.replica.checksum()  # on its own, outside the iteration: what one checksum costs
        return {
            **res.timing_s,
            "update": upd.seconds,
            "iteration": wall,
            "evaluate_cpu": evaluate_cpu,
            "tokens": sum(m.tokens for m in res.members),
            "checksum": time.perf_counter() - c0,
        }

    limit(), iteration(0)  # warm-up
    if factored:
        base_loop(0)
    limits, bases, iters = [], [], []
    for r in range(args.repeats):
        # the reference draws iteration r + 1's members and seed; reversed, it runs after that iteration's update
        # (weights a step on): other tokens with --eos, the same work without it
        arms = [
            lambda: limits.append(limit()),
            *([lambda: bases.append(base_loop(r + 1))] if factored else []),
            lambda: iters.append(iteration(r + 1)),
        ]
        for arm in interleaved(arms, r):
            arm()
    worker.engine.close()

    med = statistics.median
    out = {
        "limit_s": med(s for s, _, _ in limits),
        "limit_tokens": med(n for _, n, _ in limits),
        "limit_tok_s": med(n / s for s, n, _ in limits),
        "all_tokens": args.members * args.prompts * args.max_new_tokens,
    }  # a call's tokens when EOS never stops
    if bases:
        out.update(
            {
                "base_loop_s": med(s for s, _, _ in bases),
                "base_loop_tok_s": med(n / s for s, n, _ in bases),
                "base_loop_cpu_tok_s": med(n / c for _, n, c in bases),
                "base_loop_tokens": [n for _, n, _ in bases],
            }
        )
        out.update(paired_shares(iters, bases))
    out.update({f"{k}_s": med(it.get(k, 0.0) for it in iters) for k in (*PHASES, "checksum")})
    out["fixed_share"] = med((it["perturb"] + it["restore"] + it["update"]) / it["iteration"] for it in iters)
    out["tokens"] = med(it["tokens"] for it in iters)
    out["iteration_tokens"] = [it["tokens"] for it in iters]
    out["tok_s"] = med(it["tokens"] / it["iteration"] for it in iters)
    out["generation_tok_s"] = med(it["tokens"] / it["generate"] for it in iters)
    out["evaluate_cpu_tok_s"] = med(it["tokens"] / it["evaluate_cpu"] for it in iters)
    out["outside_generation"] = med(1 - it["generate"] / it["iteration"] for it in iters)
    return out


def interleaved(arms: list, r: int) -> list:
    """Repeat r's arms: in order on even repeats, reversed on odd ones (A B, B A, ...), so a drift of the machine's
    load hits every arm alike."""
    return arms if r % 2 == 0 else arms[::-1]


def paired_shares(iters: list[dict], bases: list[tuple[float, int, float]]) -> dict:
    """Per repeat, the lowrank iteration's tokens/s over the reference's (wall seconds, CPU seconds, tokens) run next
    to it in the same repeat: a drift between repeats cancels in each ratio."""
    pairs = list(zip(iters, bases, strict=True))
    return {
        "share_repeats": [(it["tokens"] / it["generate"]) / (n / s) for it, (s, n, _) in pairs],
        "iteration_share_repeats": [(it["tokens"] / it["iteration"]) / (n / s) for it, (s, n, _) in pairs],
        "cpu_share_repeats": [(it["tokens"] / it["evaluate_cpu"]) / (n / c) for it, (_, n, c) in pairs],
    }


def run_phase(args, engine_name: str, perturbation: str) -> dict:
    """One (engine, perturbation) in a fresh subprocess: its figures, or {"error": the last line of its error}."""
    cmd = [
        sys.executable,
        __file__,
        "--child",
        f"{engine_name}:{perturbation}",
        "--model",
        args.model,
        "--members",
        str(args.members),
        "--prompts",
        str(args.prompts),
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--threads",
        str(args.threads),
        "--rank",
        str(args.rank),
        "--repeats",
        str(args.repeats),
        *(["--vllm-compiled"] if args.vllm_compiled else []),
        *(["--eos"] if args.eos else []),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not line:
        print(f"{engine_name} {perturbation} failed:\n{proc.stderr[-3000:]}", file=sys.stderr, flush=True)
        last = [x for x in proc.stderr.strip().splitlines() if x.strip()]
        return {"error": last[-1] if last else f"exit status {proc.returncode}"}
    print(f"done {engine_name} {perturbation}", file=sys.stderr, flush=True)
    return json.loads(line[-1][len("RESULT ") :])


def share_verdict(repeats: list[float]) -> dict:
    """Paired shares of one figure (the population's tokens/s over its reference's, per repeat) against the bound
    that the reference does strictly less work: their median, lowest and highest, and ``defect`` when so many repeats
    are above 100% that a reference doing the same work puts them there by chance at most ``DEFECT_FALSE_ALARM`` of
    the time (a sign test: each such repeat is above 100% with a chance of at most one half, so k of n above has the
    binomial tail; at 3 repeats, all three above). Requiring every repeat above it instead would let one noisy repeat
    veto a real defect, and more and more often as the repeats grow. A median above 100% short of that is within the
    repeats' spread: ``above_within_noise``, no defect; below 3 repeats no count is a defect."""
    median = statistics.median(repeats)
    low, high = min(repeats), max(repeats)
    n, above = len(repeats), sum(r > 1.0 for r in repeats)
    by_chance = sum(math.comb(n, k) for k in range(above, n + 1)) / 2**n
    defect = by_chance <= DEFECT_FALSE_ALARM
    return {
        "share": median,
        "low": low,
        "high": high,
        "defect": defect,
        "above_within_noise": median > 1.0 and not defect,
    }


def judge_reference(key: str, res: dict, engine_name: str) -> dict:
    """lowrank's shares of its reference (d), medians of the paired repeats with their spread, and whether the two
    arms did the same work: every row of both generated --max-new-tokens tokens (EOS suppressed, the default), so
    they ran the same decode steps and counted the same tokens. Otherwise (``--eos``) the share is printed but not
    judged: rows stopping at other steps make it a measure of where the rows stopped, not of the term."""
    out: dict = {}
    figures = {"share_of_base_loop": "share_repeats", "iteration_share_of_base_loop": "iteration_share_repeats"}
    if engine_name == "hf":
        # CPU seconds of the calling thread (evaluate: generation and scoring), less inflated by other processes
        # (vLLM computes in its engine process: wall time only)
        figures["cpu_share_of_base_loop"] = "cpu_share_repeats"
    verdicts = {}
    for figure, repeats in figures.items():
        verdicts[figure] = v = share_verdict(res[repeats])
        out[f"{key}_{figure}"] = v["share"]
        out[f"{key}_{figure}_range"] = [v["low"], v["high"]]
    tokens = {*res["iteration_tokens"], *res["base_loop_tokens"]}
    out[f"{key}_same_work"] = same = tokens == {res["all_tokens"]}
    if same:
        # the term only adds work to its reference: beating it in more repeats than chance means the two did not
        # measure the same work. Judged on the target's figure (hf: CPU seconds, which other processes on the cores
        # inflate less)
        figure = TARGETS.get((engine_name, "lowrank"), ("share_of_base_loop",))[0]
        out[f"{key}_defect"] = verdicts[figure]["defect"]
        out[f"{key}_above_within_noise"] = verdicts[figure]["above_within_noise"]
    return out


def collect(engine_name: str, phases: dict[str, dict]) -> dict:
    """The JSON keys of one engine from its phases' figures."""
    out: dict = {}
    full, low = phases["full"], phases["lowrank"]
    if "limit_tok_s" in full:
        out.update({f"{engine_name}_limit_{k}": full[f"limit_{k}"] for k in ("tok_s", "s", "tokens")})
    if "limit_tok_s" in low:
        out[f"{engine_name}_limit_lowrank_engine_tok_s"] = low["limit_tok_s"]
    if "base_loop_tok_s" in low:
        out[f"{engine_name}_base_loop_tok_s"] = low["base_loop_tok_s"]
    for mode, res in phases.items():
        key = f"{engine_name}_{mode}"
        if "error" in res:
            out[f"{key}_error"] = res["error"]
            continue
        out[f"{key}_tok_s"] = res["tok_s"]
        if f"{engine_name}_limit_tok_s" in out:
            out[f"{key}_share_of_limit"] = res["tok_s"] / out[f"{engine_name}_limit_tok_s"]
        if mode == "lowrank" and "base_loop_tok_s" in res:  # side by side in the same process
            out.update(judge_reference(key, res, engine_name))
        if mode == "full":
            out[f"{key}_fixed_s"] = res["perturb_s"] + res["restore_s"] + res["update_s"]
            out[f"{key}_fixed_share"] = res["fixed_share"]
            out[f"{key}_checksum_s"] = res["checksum_s"]
        out[f"{key}_outside_generation"] = res["outside_generation"]
        out.update({f"{key}_{k}_s": res[f"{k}_s"] for k in PHASES})
        out[f"{key}_tokens"] = res["tokens"]
        target = TARGETS.get((engine_name, mode))
        if target and f"{key}_{target[0]}" in out and out.get(f"{key}_same_work", True):
            value = out[f"{key}_{target[0]}"]
            met = value >= target[2] if target[1] == ">=" else value < target[2]
            out[f"{key}_target_met"] = met and not out.get(f"{key}_defect", False)
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
        if f"{e}_base_loop_tok_s" in figures:
            print(
                f"{e}: lowrank's reference, the same generation loop with the low-rank term off: "
                f"{figures[f'{e}_base_loop_tok_s']:.1f} tok/s; lowrank, medians of the paired repeats [lowest, "
                f"highest]: generation {share_range(figures, f'{e}_lowrank_share_of_base_loop')} of it, its "
                f"iteration {share_range(figures, f'{e}_lowrank_iteration_share_of_base_loop')}"
                + (
                    f"; in CPU seconds, evaluate {share_range(figures, f'{e}_lowrank_cpu_share_of_base_loop')}"
                    if f"{e}_lowrank_cpu_share_of_base_loop" in figures
                    else ""
                )
            )
            if figures.get(f"{e}_lowrank_share_of_limit") is not None:
                print(
                    f"{e}: lowrank {figures[f'{e}_lowrank_share_of_limit']:.1%} of the shared-prefill limit (a "
                    "repeated prompt prefilled once, which members cannot share: not a bound)"
                )
            if not figures.get(f"{e}_lowrank_same_work"):
                print(
                    f"{e}: lowrank and its reference generated other tokens (--eos: rows stop where each model "
                    "answers), so the share measures where rows stopped, not the term: not judged"
                )
            elif figures.get(f"{e}_lowrank_defect"):
                print(
                    f"{e}: BENCHMARK DEFECT: lowrank beat its reference in more repeats than chance, and the "
                    "reference does strictly less work; the share is not a measurement of the term's cost (fix the "
                    "reference)"
                )
            elif figures.get(f"{e}_lowrank_above_within_noise"):
                print(
                    f"{e}: lowrank's median share is above 100% in too few repeats to rule out chance: within the "
                    "repeats' spread, the term's cost is below this machine's noise (more --repeats, a quieter "
                    "machine)"
                )
        if f"{e}_full_fixed_s" in figures:
            print(
                f"{e}: full rank's fixed costs (perturb + restore + update with its checksum): "
                f"{figures[f'{e}_full_fixed_s']:.3f} s = {figures[f'{e}_full_fixed_share']:.1%} of the iteration; "
                f"one checksum alone {figures[f'{e}_full_checksum_s']:.3f} s"
            )
        if f"{e}_limit_lowrank_engine_tok_s" in figures:
            print(
                f"{e}: the limit call on the low-rank phase's engine: "
                f"{figures[f'{e}_limit_lowrank_engine_tok_s']:.1f} tok/s"
            )
    print("targets:")
    for e in engines:
        for mode in PERTURBATIONS:
            key, target = f"{e}_{mode}", TARGETS.get((e, mode))
            if target is None:
                if f"{key}_tok_s" in figures:
                    print(
                        f"  {e} {mode}: reported as measured ({figures.get(f'{key}_share_of_limit', 0):.1%} of the "
                        f"limit, {figures[f'{key}_outside_generation']:.1%} outside generation); its target holds "
                        "on a GPU only"
                    )
                continue
            figure, op, bound, words = target
            value = figures.get(f"{key}_{figure}")
            verdict = (
                "n/a (not measured)"
                if value is None
                else f"{value:.1%} -> n/a (not the same work)"
                if not figures.get(f"{key}_same_work", True)
                else f"{value:.1%} -> "
                + (
                    "DEFECT (above 100% in more repeats than chance)"
                    if figures.get(f"{key}_defect")
                    else "PASS"
                    if figures[f"{key}_target_met"]
                    else "FAIL"
                )
            )
            print(f"  {e} {mode}: {op} {bound:.0%} {words}: {verdict}")


def share_range(figures: dict, key: str) -> str:
    """A paired share's median with its lowest and highest repeat."""
    low, high = figures[f"{key}_range"]
    return f"{figures[key]:.1%} [{low:.1%}, {high:.1%}]"


def machine() -> dict:
    """The machine the figures are from: CPU model, the flags that decide matmul speed, cores, torch threads, the
    load average (other processes on the cores) before the run."""
    import torch

    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not model:
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    wanted = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")
    return {
        "cpu_model": model or "unknown",
        "cpu_flags": [f for f in wanted if f in flags],
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "load_average_1m": os.getloadavg()[0],
    }


def load_after() -> dict:
    """The load average (1, 5, 15 minutes) when the run ends: with the one before it, how busy the cores were."""
    return {"load_average_end": list(os.getloadavg())}


KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def kind_of(name: str) -> str:
    leaf = name.removesuffix(".weight").rsplit(".", 1)[-1]
    return leaf if leaf in KINDS else "lm_head" if "lm_head" in name or "embed" in name else "other"


def profile(args) -> dict:
    """--profile (hf): the limit (rows with equal prompts share a prefill), the same rows each prefilled, and the
    low-rank population of those rows, interleaved, with timed wrappers: seconds in the base linear layers (F.linear,
    per layer kind; in the low-rank phase ``hf_lowrank.base_gemm``, the same GEMM accumulating into the term), in the
    low-rank term (``LowRankTerms.term``, per kind), in the layers' forward replacement around them (dispatch,
    "hooks and reshapes"), and the rest (attention, norms, the KV cache), split by prefill
    and decode (a forward of one position per row is decode; the limit's shared prefill counts as prefill).
    Seconds are CPU seconds of the calling thread (``time.thread_time``; torch runs its one thread there), which
    other processes on the cores inflate far less than wall time. Medians over the repeats."""
    import torch.nn.functional as F

    from es_ray.engines import hf_lowrank
    from es_ray.strategy import ask
    from es_ray.es.worker import ESWorker

    cfg = build_config(args, "hf", "lowrank")
    worker = ESWorker(cfg)
    eng = worker.engine
    if not args.eos:
        all_tokens(eng, args.max_new_tokens)
    train = templated_prompts(eng, worker.task)["train"]
    prompts = [train[i] for i in range(cfg.es.prompts_per_iteration)]
    rows = prompts * cfg.es.population
    kinds = {id(p): kind_of(n) for n, p in eng.model.named_parameters()}
    acc: dict[str, float] = {}
    phase = ["decode"]

    def add(key: str, dt: float) -> None:
        acc[key] = acc.get(key, 0.0) + dt

    linear, term, make_forward = F.linear, hf_lowrank.LowRankTerms.term, hf_lowrank.LowRankTerms._forward
    base_gemm = hf_lowrank.base_gemm
    base = eng.model.base_model  # the transformer without the LM head; the limit's shared prefill calls it too
    base_forward = base.forward
    clock = time.thread_time

    def timed_linear(x, weight, bias=None):
        t0 = clock()
        out = linear(x, weight, bias)
        add(f"{phase[0]}/linear/{kinds.get(id(weight), 'other')}", clock() - t0)
        return out

    def timed_base_gemm(out, x, weight):
        t0 = clock()
        base_gemm(out, x, weight)
        add(f"{phase[0]}/linear/{kinds.get(id(weight), 'other')}", clock() - t0)
        return out

    def timed_term(self, name, x, bias=None):
        t0 = clock()
        out = term(self, name, x, bias)
        add(f"{phase[0]}/term/{kind_of(name)}", clock() - t0)
        return out

    def timed_make_forward(self, name, module):
        inner = make_forward(self, name, module)

        def forward(x):
            t0 = clock()
            out = inner(x)
            add(f"{phase[0]}/layer_forward", clock() - t0)
            return out

        return forward

    def timed_base_forward(*a, **kw):
        ids = kw.get("input_ids", a[0] if a else None)
        phase[0] = "prefill" if ids is not None and ids.shape[-1] > 1 else "decode"
        t0 = clock()
        out = base_forward(*a, **kw)
        add(f"{phase[0]}/model", clock() - t0)
        return out

    F.linear = timed_linear
    hf_lowrank.LowRankTerms.term = timed_term
    hf_lowrank.base_gemm = timed_base_gemm
    hf_lowrank.LowRankTerms._forward = timed_make_forward
    base.forward = timed_base_forward

    def run(mode: str, t: int) -> dict:
        worker.replica.restore()
        acc.clear()
        t0 = clock()
        if mode == "lowrank":
            members = ask(cfg.es.population, cfg.es.estimator)
            done = [
                c
                for m in worker.replica.generate_members(t, list(members), cfg.es.sigma, prompts, cfg.sampling, 0)
                for c in m
            ]
        else:
            done = eng.generate(rows, cfg.sampling, seed=0, share_prompts=mode == "limit")
        cpu = clock() - t0
        return {
            "generate": cpu,
            "tokens": sum(c.num_tokens for c in done),
            "steps": max(c.num_tokens for c in done),
            **dict(acc),
        }

    modes = ("limit", "limit_rows", "lowrank")
    [run(m, 0) for m in modes]  # warm-up
    runs = {m: [] for m in modes}
    for r in range(args.repeats):
        for m in modes:
            runs[m].append(run(m, r + 1))
    base.__dict__.pop("forward", None)
    eng.close()
    out = {}
    for m, rs in runs.items():
        keys = sorted({k for x in rs for k in x})
        fig = {k: statistics.median(x.get(k, 0.0) for x in rs) for k in keys}
        for ph in ("prefill", "decode"):
            parts = sum(v for k, v in fig.items() if k.startswith(f"{ph}/linear/") or k.startswith(f"{ph}/term/"))
            glue = fig.get(f"{ph}/layer_forward", 0.0)
            if glue:  # the forward replacement's own time: its wall minus the linear and the term inside it
                glue -= sum(
                    v
                    for k, v in fig.items()
                    if k.startswith(f"{ph}/term/") or (k.startswith(f"{ph}/linear/") and k.split("/")[-1] in KINDS)
                )
                fig[f"{ph}/layer_forward"] = glue
            fig[f"{ph}/model"] = fig.get(f"{ph}/model", 0.0) + fig.get(f"{ph}/linear/lm_head", 0.0)
            fig[f"{ph}/rest"] = fig[f"{ph}/model"] - parts - max(glue, 0.0)
        fig["outside_forward"] = fig["generate"] - fig["prefill/model"] - fig["decode/model"]
        out[m] = fig
    tok_s = {m: out[m]["tokens"] / out[m]["generate"] for m in modes}
    out["lowrank_share_of_rows_limit"] = tok_s["lowrank"] / tok_s["limit_rows"]
    out["lowrank_share_of_limit"] = tok_s["lowrank"] / tok_s["limit"]
    return out


def profile_vllm(args) -> dict:
    """--profile (vLLM, CPU build): one LoRA-enabled engine, interleaved: the limit's rows each prefilled (no LoRA, each
    row its own prefix-cache salt), the low-rank population (``generate_members``), and the same with the linear
    layers' LoRA kernel (``PunicaWrapperCPU.add_lora_linear``, ``vllm_extension._add_lora_linear``) a no-op: the
    population's gap to the rows splits into that kernel (its own CPU seconds, timed inside, and population minus
    no-op) and vLLM's own LoRA path (no-op minus rows: metadata per step, the LoRA layers' wrappers). EOS is ignored
    in every mode unless --eos (each row generates --max-new-tokens). CPU seconds of the calling thread (the engine
    core runs in it with one thread) and wall seconds, medians."""
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    from es_ray.es.worker import ESWorker
    from es_ray.strategy import ask

    cfg = build_config(args, "vllm", "lowrank")
    worker = ESWorker(cfg)
    eng = worker.engine
    prompts = [templated_prompts(eng, worker.task)["train"][i] for i in range(cfg.es.prompts_per_iteration)]
    members = list(ask(cfg.es.population, cfg.es.estimator))
    each_row = each_row_generation(eng)
    kernel, clock = PunicaWrapperCPU.add_lora_linear, time.thread_time
    kernel_s = [0.0]

    def timed(self, *a, **kw):
        t0 = clock()
        kernel(self, *a, **kw)
        kernel_s[0] += clock() - t0

    if not args.eos:
        all_tokens(eng, args.max_new_tokens)
    kernels = {"lowrank": timed, "lowrank_no_kernel": lambda self, *a, **kw: None}

    def run(mode: str, t: int) -> dict:
        kernel_s[0] = 0.0
        PunicaWrapperCPU.add_lora_linear = kernels.get(mode, kernel)
        t0, c0 = time.perf_counter(), clock()
        if mode == "limit_rows":
            done = each_row(prompts * cfg.es.population, cfg.sampling, 0)
        else:
            done = [
                c
                for m in worker.replica.generate_members(t, members, cfg.es.sigma, prompts, cfg.sampling, 0)
                for c in m
            ]
        return {
            "cpu": clock() - c0,
            "wall": time.perf_counter() - t0,
            "kernel_cpu": kernel_s[0],
            "tokens": sum(c.num_tokens for c in done),
        }

    modes = ("limit_rows", "lowrank", "lowrank_no_kernel")
    [run(m, 0) for m in modes]  # warm-up
    runs: dict[str, list] = {m: [] for m in modes}
    for r in range(args.repeats):
        for m in modes if r % 2 == 0 else modes[::-1]:
            runs[m].append(run(m, r + 1))
    PunicaWrapperCPU.add_lora_linear = kernel
    eng.close()
    out: dict = {m: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for m, rs in runs.items()}
    rows, low, bare = out["limit_rows"], out["lowrank"], out["lowrank_no_kernel"]
    out["lowrank_cpu_share_of_rows_limit"] = rows["cpu"] / low["cpu"]
    out["lowrank_wall_share_of_rows_limit"] = rows["wall"] / low["wall"]
    out["gap_cpu_s"] = low["cpu"] - rows["cpu"]
    out["kernel_cpu_s"] = low["kernel_cpu"]
    out["vllm_lora_path_cpu_s"] = bare["cpu"] - rows["cpu"]
    return out


def report_vllm_profile(prof: dict) -> None:
    print(
        "profile (vllm, seconds per generate call, medians): "
        + ", ".join(
            f"{m}: {prof[m]['cpu']:.2f} CPU s, {prof[m]['wall']:.2f} wall s, {prof[m]['tokens']:.0f} tokens"
            for m in ("limit_rows", "lowrank", "lowrank_no_kernel")
        )
    )
    print(
        f"lowrank: {prof['lowrank_cpu_share_of_rows_limit']:.1%} of limit_rows in CPU seconds "
        f"({prof['lowrank_wall_share_of_rows_limit']:.1%} wall); its {prof['gap_cpu_s']:.2f} s more: the LoRA "
        f"kernel {prof['kernel_cpu_s']:.2f} s, vLLM's own LoRA path {prof['vllm_lora_path_cpu_s']:.2f} s"
    )


def report_profile(prof: dict) -> None:
    modes = [m for m in prof if isinstance(prof[m], dict)]
    print(
        "profile (hf, CPU seconds per generate call, medians): "
        + ", ".join(
            f"{m}: {prof[m]['generate']:.2f} s, {prof[m]['tokens']:.0f} tokens, {prof[m]['steps']:.0f} steps"
            for m in modes
        )
    )
    rows = []
    for ph in ("prefill", "decode"):
        rows += [(f"{ph} linear {k}", f"{ph}/linear/{k}") for k in (*KINDS, "lm_head")]
        rows += [(f"{ph} term {k}", f"{ph}/term/{k}") for k in KINDS]
        rows += [
            (f"{ph} forward replacement", f"{ph}/layer_forward"),
            (f"{ph} rest", f"{ph}/rest"),
            (f"{ph} total", f"{ph}/model"),
        ]
    rows += [("outside the forward", "outside_forward"), ("generate", "generate")]
    print(f"{'':<28}" + "".join(f"{m:>12}" for m in modes))
    for label, key in rows:
        vals = [prof[m].get(key, 0.0) for m in modes]
        if any(vals):
            print(f"{label:<28}" + "".join(f"{v:>12.3f}" for v in vals))
    print(
        f"lowrank tok/s (CPU): {prof['lowrank_share_of_rows_limit']:.1%} of limit_rows (the same rows, each "
        f"prefilled), {prof['lowrank_share_of_limit']:.1%} of limit (a repeated prompt prefilled once)"
    )


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
    ap.add_argument(
        "--profile",
        action="store_true",
        help="where the low-rank phase's generation time goes, beside the limit (see profile, profile_vllm)",
    )
    ap.add_argument(
        "--eos",
        action="store_true",
        help="rows stop at EOS as a run's do (default: every row generates --max-new-tokens tokens, so "
        "every mode runs the same decode steps; see all_tokens); lowrank's share of its reference "
        "is then not judged",
    )
    ap.add_argument("--no-eos", action="store_true", help="the default (kept for earlier commands)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if min(args.members, args.prompts, args.max_new_tokens, args.threads, args.repeats) < 1:
        ap.error("--members, --prompts, --max-new-tokens, --threads and --repeats must be >= 1")
    if args.members < 2:
        ap.error("--members must be >= 2 (es.population >= 2)")
    if args.eos and args.no_eos:
        ap.error("--eos and --no-eos contradict each other: drop one (--no-eos is the default)")
    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        engine_name, perturbation = args.child.split(":")
        if perturbation == "profile":
            res = profile(args) if engine_name == "hf" else profile_vllm(args)
        else:
            res = measure(args, engine_name, perturbation)
        print("RESULT " + json.dumps(res), flush=True)
        return
    host = machine()
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if args.profile:
        profiles = {}
        for e in engines:
            profiles[f"{e}_profile"] = prof = run_phase(args, e, "profile")
            if "error" in prof:
                sys.exit(f"{e} profile failed: {prof['error']}")
            (report_profile if e == "hf" else report_vllm_profile)(prof)
        print(
            json.dumps(
                {
                    "machine": {**host, "torch_threads": args.threads, **load_after()},
                    "members": args.members,
                    "prompts": args.prompts,
                    "max_new_tokens": args.max_new_tokens,
                    "rank": args.rank,
                    "no_eos": not args.eos,
                    "repeats": args.repeats,
                    **profiles,
                }
            )
        )
        return

    figures: dict = {}
    for e in engines:
        figures.update(collect(e, {mode: run_phase(args, e, mode) for mode in PERTURBATIONS}))
    report(figures, engines)
    settings = {
        "model": args.model,
        "engines": engines,
        "members": args.members,
        "prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "threads": args.threads,
        "rank": args.rank,
        "repeats": args.repeats,
        "batch_size": batch_size(args),
        "vllm_enforce_eager": not args.vllm_compiled,
        "no_eos": not args.eos,
    }
    print(json.dumps({"machine": {**host, "torch_threads": args.threads, **load_after()}, **settings, **figures}))
    if any(k.endswith("_error") for k in figures):
        sys.exit(1)


if __name__ == "__main__":
    main()
