"""`es-eval`: evaluate a checkpoint on the paper's benchmarks.

    es-eval model.path=/abs/run/checkpoints/final eval.tasks=[gpqa,math500] eval.n=32 eval.k=[1,16,32]
    es-eval eval.data_dir=/data/benchmarks eval.limit=50 cluster.num_actors=4 cluster.gpus_per_actor=1

Every problem gets eval.n samples. The work is cut into seeded chunks (``es_ray.evaluation.worker``) that go to
``cluster.num_actors`` Ray actors as each becomes free (0: run in this process). Where one actor on this machine
would do all the work (``in_process_reason``: one chunk, or cluster.num_actors=1, on a local Ray not yet started
or started here with one node, CPU-only, the transformers engine) the chunks run in this process without an actor,
which the log says; the results are the same (each chunk has its own seed, and the process takes the actor's torch
threads). The driver computes pass@k, maj@k and the entropy summary and writes results.json, results.md and
samples.jsonl to run.dir.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

from es_ray.engines import ENGINES
from es_ray.evaluation.compat import check_same_vocabulary
from es_ray.evaluation.config import EvalJobConfig, register_configs, to_eval_config
from es_ray.grading.mathverify import close_default_pool
from es_ray.grading.result import FAILURE_KINDS
from es_ray.grading.sandbox import isolation
from es_ray.metrics.passk import maj_at_k, mean_pass_at_k
from es_ray.metrics.report import results_markdown
from es_ray.models import resolve_model
from es_ray.runtime import actors, cluster
from es_ray.runtime import placement as placements
from es_ray.runtime.cluster import LOCAL_ADDRESSES
from es_ray.runtime.entry import TRAINING_RUN_KEYS, hydra_main, run_or_exit
from es_ray.runtime.rundir import open_run_dir, releases_run_dir
from es_ray.evaluation.worker import (
    Chunk,
    EvalWorker,
    entropy_temperatures,
    in_eval_keys,
    load_eval_task,
    plan_chunks,
    task_config,
)
from es_ray.runtime.signals import InterruptGuard
from es_ray.runtime.tracking import log_summary, shows_bar

# torch, tqdm and the torch-backed metrics (entropy, KL) are imported where the evaluation runs: --help, a config error
# and the driver side need none of them.


def in_process_reason(cfg: EvalJobConfig, chunks: list[Chunk]) -> str:
    """Why the chunks run in this process, or "" when they go to Ray actors: cluster.num_actors=0, or one actor on
    this machine would take every chunk (one chunk, or cluster.num_actors=1) on CPU with the transformers engine,
    the Ray being local (no cluster.address, no RAY_ADDRESS) and either not running yet or started by this process
    with no other node (es-compare's own Ray between its training stages): starting Ray, or an actor process and
    its imports (torch and the engine's libraries loaded again in a fresh process: the ``ray_start`` and
    ``actor_spawn`` phases of benchmarks/startup.py), would then only add to the same work done by one worker."""
    c = cfg.cluster
    if c.num_actors == 0:
        return "cluster.num_actors=0"
    busy = min(c.num_actors, len(chunks))
    if (
        busy != 1
        or c.address not in LOCAL_ADDRESSES
        or os.environ.get("RAY_ADDRESS")
        or c.gpus_per_actor > 0
        or not ENGINES.get(cfg.engine.name).in_process
    ):  # vLLM keeps its actor unless num_actors=0
        return ""
    what = "one chunk of work" if len(chunks) == 1 else "cluster.num_actors=1"
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return f"{what} for one actor on this machine, so no local Ray is started"
    if not _started_here_as_one_node(ray):
        return ""
    return f"{what} for one actor, on the one-node Ray this process started, so no actor is started"


def _started_here_as_one_node(ray) -> bool:
    """This process started the Ray it is connected to (``ray.init`` with no address to join: es-compare's own, a
    test's), and no other node has joined it. A Ray joined by address (``ray start`` on this machine, a cluster)
    keeps the actors: its CPUs are shared by whoever else uses it."""
    try:  # ray._private.worker (Ray 2.60, pinned): the node is a head only where this process's ray.init started it
        started = ray._private.worker._global_node.head
    except AttributeError:  # not connected, or a Ray without it: keep the actors
        return False
    if not started:
        return False
    return sum(1 for n in ray.nodes() if n.get("Alive")) == 1


def _run_here(cfg: EvalJobConfig, chunks: list[Chunk], progress) -> list[dict]:
    """The chunks in this process, as one actor would run them. The process may live on (es-compare's driver goes
    on to its next stage), so what the worker changed is put back after: torch's thread count (the worker takes
    the actor's), the model and engine released, the grader's processes ended."""
    import torch

    threads = torch.get_num_threads()
    worker = None
    try:
        worker = EvalWorker(cfg)
        out = []
        for c in chunks:
            out.append(worker.run_chunk(c))
            progress(c)
        return out
    finally:
        del worker
        close_default_pool()
        torch.set_num_threads(threads)
        gc.collect()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()


def _run_chunks(cfg: EvalJobConfig, chunks: list[Chunk], progress, in_process: bool | None = None) -> list[dict]:
    """Every chunk, in this process (``in_process``; None: ``in_process_reason``) or on the runtime's actor group
    (placement group with the fit check, each actor taking the next chunk when free, dead or silent actors
    replaced)."""
    if in_process is None:
        in_process = bool(in_process_reason(cfg, chunks))
    if in_process:
        return _run_here(cfg, chunks, progress)
    cluster.connect(cfg.cluster)
    placement = placements.place(cfg.cluster, "eval")
    group = None
    try:
        with InterruptGuard() as guard:
            group, _ = actors.start_group(
                "eval",
                EvalWorker,
                cfg.cluster.num_actors,
                lambda rank: (cfg, rank),
                placement,
                cfg.faults,
                check_interrupt=guard.check,
                lost_advice="run es-eval again (its chunks are seeded, so results are the same)",
                tokens_key="eval.max_new_tokens",
            )
            out = []
            for (chunk,), res in group.map_unordered(EvalWorker.run_chunk, [(c,) for c in chunks]):
                out.append(res)
                progress(chunk)
            return out
    finally:
        if group is not None:
            group.kill()
        placement.release()


def summarize_task(
    task, n: int, ks: list[int], samples: list[dict], hist: np.ndarray, skipped: int, source: str
) -> dict:
    from es_ray.metrics.entropy import summarize_stats

    by_problem: dict[int, list[dict]] = {}
    for s in sorted(samples, key=lambda s: (s["problem"], s["sample"])):
        by_problem.setdefault(s["problem"], []).append(s)
    problems = [by_problem[p] for p in sorted(by_problem)]
    correct_p = [sum(bool(s["correct"]) for s in ss) for ss in problems]
    pass_k = mean_pass_at_k(correct_p, n, ks) if problems else {k: None for k in ks}
    maj_k = None
    if task.majority_vote and problems:
        answers = [[s["answer"] for s in ss] for ss in problems]
        correct = [[bool(s["correct"]) for s in ss] for ss in problems]
        maj_k = {str(k): maj_at_k(answers, correct, k) for k in ks}
    failures = Counter(s["failure"] for s in samples if s["failure"])
    tokens = sum(s["tokens"] for s in samples)
    return {
        "problems": len(problems),
        "n": n,
        "source": source,
        "pass@k": {str(k): v for k, v in pass_k.items()},
        "maj@k": maj_k,
        "mean_reward": float(np.mean([s["score"] for s in samples])) if samples else None,
        "grader_failures": {kind: failures.get(kind, 0) for kind in FAILURE_KINDS}
        | {k: v for k, v in failures.items() if k not in FAILURE_KINDS},
        "skipped_rows": skipped,
        "tokens": {"generated": tokens, "mean_per_completion": tokens / len(samples) if samples else None},
        "entropy": summarize_stats([s["entropy_sum"] for s in samples], [s["entropy_tokens"] for s in samples], hist)
        if samples and any(s["entropy_tokens"] for s in samples)
        else None,
        "entropy_t1": entropy_at_t1(samples),
        "entropy_untruncated": entropy_at_t1(samples, "entropy_sum_untruncated"),
        "answer_checks": answer_checks(problems, n, ks) if any(s.get("checks") for s in samples) else None,
    }


def entropy_at_t1(samples: list[dict], key: str = "entropy_sum_t1") -> dict | None:
    """Mean entropy per token of the model's own distribution (T = 1), beside ``entropy`` (the sampled one: the
    top_p nucleus renormalised when top_p < 1); key="entropy_sum_untruncated": the untruncated one at T."""
    tokens = sum(s["entropy_tokens"] for s in samples)
    if not tokens:
        return None
    return {"mean_per_token": sum(s.get(key, 0.0) for s in samples) / tokens, "tokens": tokens}


def answer_checks(problems: list[list[dict]], n: int, ks: list[int]) -> dict:
    """Correct samples with no final boxed answer and correct samples whose answer only restates the problem, and
    pass@k with those counted wrong (how much of pass@k they make)."""

    def flagged(s: dict) -> bool:
        return bool(s["correct"]) and (not s["checks"].get("boxed", True) or s["checks"].get("restated", False))

    correct = [s for ss in problems for s in ss if s["correct"]]
    strict_p = [sum(bool(s["correct"]) and not flagged(s) for s in ss) for ss in problems]
    return {
        "correct_without_box": sum(not s["checks"].get("boxed", True) for s in correct),
        "correct_restating": sum(bool(s["checks"].get("restated")) for s in correct),
        "pass@k_without_them": {str(k): v for k, v in mean_pass_at_k(strict_p, n, ks).items()},
    }


@releases_run_dir
def run(cfg: EvalJobConfig) -> dict:
    from es_ray.metrics.entropy import HIST_EDGES, summarize_stats

    t_start = time.perf_counter()
    model_dir = resolve_model(cfg.model.path)  # converts the embedded model once, before any actor starts
    if cfg.eval.kl_base:  # refused in one line before any model loads when the vocabularies differ
        check_same_vocabulary(resolve_model(cfg.eval.kl_reference), model_dir, "eval.kl_reference", "model.path")
    tasks, sizes = {}, {}
    for name in cfg.eval.tasks:  # fail fast on a missing file or an unreachable hub, before any generation
        task, problems = load_eval_task(cfg, name)
        tasks[name], sizes[name] = task, len(problems)
        for line in task.skipped_lines():
            print(f"es-eval: {in_eval_keys(line, name)}", flush=True)
    chunks = plan_chunks(cfg, sizes)
    local = in_process_reason(cfg, chunks)
    if not local:  # a bad cluster.address fails here, before any output
        cluster.connect(cfg.cluster)
    elif cfg.cluster.num_actors:  # chosen here, not asked for: said, with how to keep the actors
        print(
            f"es-eval: evaluating in this process ({local}); set cluster.address= to a running cluster to use "
            "its actors",
            flush=True,
        )
    run_dir = open_run_dir(cfg, "eval")
    outputs = _run_with_progress(cfg, chunks, bool(local))
    samples: dict[str, list[dict]] = {name: [] for name in cfg.eval.tasks}
    hists = {name: np.zeros(len(HIST_EDGES) - 1, dtype=np.int64) for name in cfg.eval.tasks}
    seconds = Counter()
    kl_parts: dict[str, list[dict]] = {name: [] for name in cfg.eval.tasks}
    for out in outputs:
        samples[out["task"]].extend(out["samples"])
        if out.get("kl"):
            kl_parts[out["task"]].append(out["kl"])
        hists[out["task"]] += np.asarray(out["entropy_hist"], dtype=np.int64)
        seconds.update(out["seconds"])
    ks = list(cfg.eval.k)
    per_task = {
        name: summarize_task(
            tasks[name],
            cfg.eval.n,
            ks,
            samples[name],
            hists[name],
            tasks[name].skipped_rows,
            task_config(cfg, name).path or "hub",
        )
        for name in cfg.eval.tasks
    }
    if cfg.eval.kl_base:
        from es_ray.metrics.kl import summarize_kl

        for name in cfg.eval.tasks:
            parts = kl_parts[name]
            per_task[name]["kl"] = summarize_kl(
                [s for p in parts for s in p["sums"]], [i for p in parts for i in p["problems"]]
            )
    everything = [s for name in cfg.eval.tasks for s in samples[name]]
    results = {
        "model": cfg.model.path or "embedded SmolLM2-135M-Instruct",
        "model_dir": str(model_dir),
        "settings": {
            "engine": cfg.engine.name,
            "n": cfg.eval.n,
            "k": ks,
            "temperature": cfg.eval.temperature,
            "answer": cfg.eval.answer,
            "entropy_temperatures": list(entropy_temperatures(cfg.eval.temperature)),
            "top_p": cfg.eval.top_p,
            "max_new_tokens": cfg.eval.max_new_tokens,
            "limit": cfg.eval.limit,
            "seed": cfg.run.seed,
            "actors": 0 if local else cfg.cluster.num_actors,
            "kl_reference": (cfg.eval.kl_reference or "embedded SmolLM2-135M-Instruct") if cfg.eval.kl_base else None,
            "kl_samples": cfg.eval.kl_samples if cfg.eval.kl_base else None,
        },
        "tasks": per_task,
        "entropy": (
            summarize_stats(
                [s["entropy_sum"] for s in everything], [s["entropy_tokens"] for s in everything], sum(hists.values())
            )
            if cfg.eval.entropy and everything
            else None
        )
        or {},
        "entropy_t1": entropy_at_t1(everything) if cfg.eval.entropy else None,
        "entropy_untruncated": entropy_at_t1(everything, "entropy_sum_untruncated") if cfg.eval.entropy else None,
        "tokens_generated": sum(s["tokens"] for s in everything),
        "timing_s": {"total": time.perf_counter() - t_start, **{k: float(v) for k, v in seconds.items()}},
        "sandbox": isolation() if "mbpp" in cfg.eval.tasks else None,
        "config": dataclasses.asdict(cfg),
    }
    write_results(cfg, run_dir, results, samples)
    results["run_dir"] = str(run_dir)
    return results


def _run_with_progress(cfg: EvalJobConfig, chunks: list[Chunk], in_process: bool) -> list[dict]:
    """The chunks, with a bar counting problems done (each problem's eval.n samples) and the task last finished."""
    if not shows_bar(cfg.run.progress):
        return _run_chunks(cfg, chunks, lambda chunk: None, in_process)
    from tqdm import tqdm

    bar = tqdm(
        total=sum(len(c.problem_ids) for c in chunks),
        desc="es-eval",
        unit="problem",
        dynamic_ncols=True,
        file=sys.stderr,
    )

    def done(chunk: Chunk) -> None:
        bar.update(len(chunk.problem_ids))
        bar.set_postfix_str(f"task={chunk.task}")

    try:
        return _run_chunks(cfg, chunks, done, in_process)
    finally:
        bar.close()


def write_results(cfg: EvalJobConfig, run_dir: Path, results: dict, samples: dict[str, list[dict]]) -> None:
    """results.json, results.md, samples.jsonl (eval.save_samples) and the trackers' summary."""
    (run_dir / "results.json").write_text(json.dumps(results, indent=2))
    (run_dir / "results.md").write_text(results_markdown(results))
    if cfg.eval.save_samples:
        with open(run_dir / "samples.jsonl", "w") as f:
            for name in cfg.eval.tasks:
                for s in sorted(samples[name], key=lambda s: (s["problem"], s["sample"])):
                    f.write(json.dumps({"task": name, **s}) + "\n")
    log_summary(run_dir, cfg, tracker_metrics(results), "es-eval")


def tracker_metrics(results: dict) -> dict[str, float]:
    """results.json's numbers under the names every tracker gets (no '@': MLflow refuses it in a name)."""
    out = {
        "eval/entropy": results["entropy"].get("mean_per_token"),
        "eval/tokens": results["tokens_generated"],
        "timing_s/total": results["timing_s"]["total"],
    }
    for name, t in results["tasks"].items():
        out.update({f"eval/{name}/pass_at_{k}": v for k, v in t["pass@k"].items()})
        out.update({f"eval/{name}/maj_at_{k}": v for k, v in (t["maj@k"] or {}).items()})
        out[f"eval/{name}/mean_reward"] = t["mean_reward"]
        out[f"eval/{name}/entropy"] = (t["entropy"] or {}).get("mean_per_token")
        out.update(
            {
                f"eval/{name}/kl_{key}": v
                for key, v in (t.get("kl") or {}).items()
                if key in ("base_tuned", "tuned_base", "nucleus_base_tuned", "nucleus_tuned_base")
            }
        )
    return {k: v for k, v in out.items() if v is not None}


def _main(dict_cfg) -> None:
    results = run_or_exit("es-eval", lambda: run(to_eval_config(dict_cfg)))
    print((Path(results["run_dir"]) / "results.md").read_text())
    print(f"es-eval: results in {results['run_dir']}")


def main() -> None:
    hydra_main("es_eval", _main, "es-eval", register_configs, unread=TRAINING_RUN_KEYS)


if __name__ == "__main__":
    main()
