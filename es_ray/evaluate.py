"""`es-eval` and `es-drift`: evaluate a checkpoint on the paper's benchmarks; compare two checkpoints' weights.

    es-eval model.path=/abs/run/checkpoints/final eval.tasks=[gpqa,math500] eval.n=32 eval.k=[1,16,32]
    es-eval eval.data_dir=/data/benchmarks eval.limit=50 cluster.num_actors=4 cluster.gpus_per_actor=1
    es-drift base=Qwen/Qwen2.5-1.5B-Instruct tuned=/abs/run/checkpoints/final run.dir=/abs/drift

es-eval: every problem gets eval.n samples. The work is cut into chunks (a few problems, their n samples, one
seed each, fixed by run.seed, the task and the chunk number, so results do not depend on how many actors run
them); chunks go to ``cluster.num_actors`` Ray actors as each becomes free (0: run in this process). An actor
generates, grades (graders run in its own subprocesses) and, with eval.entropy, computes the token entropy of each
completion by a teacher-forced forward pass; it returns per-sample scalars. The driver computes pass@k, maj@k and
the entropy summary and writes results.json, results.md and samples.jsonl to run.dir.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import sys
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from es_ray.config import DriftConfig, EvaluateConfig, TaskConfig

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


@dataclass(frozen=True)
class Chunk:
    task: str
    index: int
    problem_ids: tuple[int, ...]
    seed: int


# -- tasks --------------------------------------------------------------------------------------------------


def task_path(cfg: EvaluateConfig, name: str) -> str:
    """eval.paths[name], else <eval.data_dir>/<name>.<jsonl|json|parquet|csv>, else "" (the hub)."""
    if name in cfg.eval.paths:
        return cfg.eval.paths[name]
    if cfg.eval.data_dir:
        for suffix in DATA_SUFFIXES:
            candidate = Path(cfg.eval.data_dir).expanduser() / f"{name}{suffix}"
            if candidate.is_file():
                return str(candidate)
    return ""


def task_config(cfg: EvaluateConfig, name: str) -> TaskConfig:
    from es_ray.tasks import task_class
    from es_ray.tasks.dataset import DatasetTask

    path = task_path(cfg, name)
    # Dataset tasks and files are scored whole (eval_size 0 keeps every problem out of the held-out cut);
    # a generated task (countdown without a file) is scored on its generated held-out set.
    generated = not path and not issubclass(task_class(name), DatasetTask)
    return TaskConfig(name=name, path=path, eval_size=TaskConfig.eval_size if generated else 0)


def load_eval_task(cfg: EvaluateConfig, name: str):
    from es_ray.tasks import load_task

    task = load_task(task_config(cfg, name))
    problems = task.eval_problems()
    if cfg.eval.limit:
        problems = problems[: cfg.eval.limit]
    return task, problems


def plan_chunks(cfg: EvaluateConfig, sizes: dict[str, int]) -> list[Chunk]:
    per_chunk = max(1, (cfg.eval.chunk_size or cfg.engine.batch_size) // cfg.eval.n)
    chunks = []
    for name, size in sizes.items():
        for j, start in enumerate(range(0, size, per_chunk)):
            seed = random.Random(f"{cfg.run.seed}/{name}/{j}/eval").getrandbits(62)
            chunks.append(Chunk(name, j, tuple(range(start, min(size, start + per_chunk))), seed))
    return chunks


# -- the actor ----------------------------------------------------------------------------------------------


class EvalWorker:
    """Plain class; es-eval wraps it with ``ray.remote`` (or runs it in-process with cluster.num_actors=0)."""

    def __init__(self, cfg: EvaluateConfig, rank: int = 0):
        import torch

        threads = cfg.engine.threads or max(1, int(cfg.cluster.cpus_per_actor or 1))
        torch.set_num_threads(threads)
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        from es_ray.engines.base import make_engine
        from es_ray.grading.mathverify import configure_default_pool
        from es_ray.models import resolve_model

        self.cfg, self.rank = cfg, rank
        self.model_dir = resolve_model(cfg.model.path)
        self.engine = make_engine(str(self.model_dir), cfg.engine)
        configure_default_pool(cfg.eval.grader_workers, cfg.eval.math_timeout_s)
        self._tasks: dict[str, tuple] = {}
        self._entropy = None

    def ready(self) -> dict:
        return {"rank": self.rank, "pid": os.getpid()}

    def _task(self, name: str):
        if name not in self._tasks:
            from es_ray.grading.sandbox import SandboxLimits

            task, problems = load_eval_task(self.cfg, name)
            if hasattr(task, "sandbox_limits"):
                ev = self.cfg.eval
                task.sandbox_limits = SandboxLimits(wall_s=ev.code_timeout_s, cpu_s=ev.code_timeout_s,
                                                    memory_mb=ev.code_memory_mb)
                task.sandbox_workers = ev.grader_workers
            prompts = [self.engine.apply_chat_template(task.messages(p)) for p in problems]
            self._tasks[name] = (task, problems, prompts)
        return self._tasks[name]

    def _entropy_model(self):
        """The engine's own torch model when it has one (transformers); else a copy loaded for scoring."""
        import torch

        if self._entropy is None:
            model, tok = getattr(self.engine, "model", None), getattr(self.engine, "tokenizer", None)
            if not isinstance(model, torch.nn.Module) or tok is None:
                from transformers import AutoModelForCausalLM, AutoTokenizer

                from es_ray.engines.base import resolve_device, torch_dtype

                device = resolve_device(self.cfg.engine)
                tok = AutoTokenizer.from_pretrained(self.model_dir)
                model = AutoModelForCausalLM.from_pretrained(
                    self.model_dir, dtype=torch_dtype(self.cfg.engine.dtype, device)).to(device).eval()
            self._entropy = (model, tok)
        return self._entropy

    def run_chunk(self, chunk: Chunk) -> dict:
        from es_ray.config import SamplingConfig
        from es_ray.eval.entropy import HIST_EDGES, completion_entropies, histogram

        ev = self.cfg.eval
        task, problems, prompts = self._task(chunk.task)
        ids = [i for i in chunk.problem_ids for _ in range(ev.n)]
        sampling = SamplingConfig(max_new_tokens=ev.max_new_tokens, temperature=ev.temperature, top_p=ev.top_p)
        t0 = time.perf_counter()
        completions = self.engine.generate([prompts[i] for i in ids], sampling, chunk.seed)
        t1 = time.perf_counter()
        grades = task.grade_batch([c.text for c in completions], [problems[i] for i in ids])
        t2 = time.perf_counter()
        ent_sum, ent_cnt = [0.0] * len(ids), [0] * len(ids)
        hist = np.zeros(len(HIST_EDGES) - 1, dtype=np.int64)
        if ev.entropy:
            model, tok = self._entropy_model()
            prompt_ids = {i: tok(prompts[i], add_special_tokens=False)["input_ids"] for i in chunk.problem_ids}
            for j, (i, c) in enumerate(zip(ids, completions)):
                # the generated token ids where the engine reports them; else the text re-tokenised (the same
                # tokens except where the tokenizer does not round-trip, as for random models' output)
                cids = getattr(c, "token_ids", None) or tok(c.text, add_special_tokens=False)["input_ids"]
                h = completion_entropies(model, prompt_ids[i], cids)
                ent_sum[j], ent_cnt[j] = float(h.sum()), int(h.numel())
                hist += histogram(h.numpy())
        t3 = time.perf_counter()
        samples = [{"problem": i, "sample": j % ev.n, "score": g.score, "correct": g.correct, "failure": g.failure,
                    "answer": g.answer, "tokens": c.num_tokens, "entropy_sum": s, "entropy_tokens": k,
                    "text": c.text if ev.save_samples else None}
                   for j, (i, c, g, s, k) in enumerate(zip(ids, completions, grades, ent_sum, ent_cnt))]
        return {"task": chunk.task, "chunk": chunk.index, "samples": samples, "entropy_hist": hist.tolist(),
                "seconds": {"generate": t1 - t0, "grade": t2 - t1, "entropy": t3 - t2}}


# -- the driver ---------------------------------------------------------------------------------------------


def _run_chunks(cfg: EvaluateConfig, chunks: list[Chunk], progress) -> list[dict]:
    if cfg.cluster.num_actors == 0:
        worker = EvalWorker(cfg)
        out = []
        for c in chunks:
            out.append(worker.run_chunk(c))
            progress()
        return out
    import ray
    from ray.util import ActorPool

    from es_ray.driver import connect

    connect(cfg.cluster)
    actor_cls = ray.remote(EvalWorker)
    actors = [actor_cls.options(num_cpus=cfg.cluster.cpus_per_actor, num_gpus=cfg.cluster.gpus_per_actor)
              .remote(cfg, rank) for rank in range(cfg.cluster.num_actors)]
    try:
        ray.get([a.ready.remote() for a in actors])
        out = []
        for res in ActorPool(actors).map_unordered(lambda a, c: a.run_chunk.remote(c), chunks):
            out.append(res)
            progress()
        return out
    finally:
        for a in actors:
            ray.kill(a)


def summarize_task(task, n: int, ks: list[int], samples: list[dict], hist: np.ndarray, skipped: int,
                   source: str) -> dict:
    from es_ray.eval.entropy import summarize_stats
    from es_ray.eval.passk import maj_at_k, mean_pass_at_k
    from es_ray.grading.result import FAILURE_KINDS

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
        "problems": len(problems), "n": n, "source": source,
        "pass@k": {str(k): v for k, v in pass_k.items()},
        "maj@k": maj_k,
        "mean_reward": float(np.mean([s["score"] for s in samples])) if samples else None,
        "grader_failures": {kind: failures.get(kind, 0) for kind in FAILURE_KINDS}
                           | {k: v for k, v in failures.items() if k not in FAILURE_KINDS},
        "skipped_rows": skipped,
        "tokens": {"generated": tokens, "mean_per_completion": tokens / len(samples) if samples else None},
        "entropy": summarize_stats([s["entropy_sum"] for s in samples], [s["entropy_tokens"] for s in samples],
                                   hist) if samples and any(s["entropy_tokens"] for s in samples) else None,
    }


def run(cfg: EvaluateConfig) -> dict:
    from es_ray.driver import make_run_dir
    from es_ray.eval.entropy import HIST_EDGES, summarize_stats
    from es_ray.eval.report import results_markdown
    from es_ray.grading.sandbox import isolation
    from es_ray.models import resolve_model

    t_start = time.perf_counter()
    model_dir = resolve_model(cfg.model.path)  # converts the embedded model once, before any actor starts
    tasks, sizes = {}, {}
    for name in cfg.eval.tasks:  # fail fast on a missing file or an unreachable hub, before any generation
        task, problems = load_eval_task(cfg, name)
        tasks[name], sizes[name] = task, len(problems)
    run_dir = make_run_dir(cfg, prefix="eval")
    chunks = plan_chunks(cfg, sizes)
    bar = None
    if cfg.run.progress:
        from tqdm import tqdm

        bar = tqdm(total=len(chunks), desc="es-eval", dynamic_ncols=True, file=sys.stderr)
    try:
        outputs = _run_chunks(cfg, chunks, (lambda: bar.update(1)) if bar else (lambda: None))
    finally:
        if bar is not None:
            bar.close()
    samples: dict[str, list[dict]] = {name: [] for name in cfg.eval.tasks}
    hists = {name: np.zeros(len(HIST_EDGES) - 1, dtype=np.int64) for name in cfg.eval.tasks}
    seconds = Counter()
    for out in outputs:
        samples[out["task"]].extend(out["samples"])
        hists[out["task"]] += np.asarray(out["entropy_hist"], dtype=np.int64)
        seconds.update(out["seconds"])
    ks = list(cfg.eval.k)
    per_task = {name: summarize_task(tasks[name], cfg.eval.n, ks, samples[name], hists[name],
                                     tasks[name].skipped_rows, task_config(cfg, name).path or "hub")
                for name in cfg.eval.tasks}
    everything = [s for name in cfg.eval.tasks for s in samples[name]]
    results = {
        "model": cfg.model.path or "embedded SmolLM2-135M-Instruct", "model_dir": str(model_dir),
        "settings": {"engine": cfg.engine.name, "n": cfg.eval.n, "k": ks, "temperature": cfg.eval.temperature,
                     "top_p": cfg.eval.top_p, "max_new_tokens": cfg.eval.max_new_tokens, "limit": cfg.eval.limit,
                     "seed": cfg.run.seed, "actors": cfg.cluster.num_actors},
        "tasks": per_task,
        "entropy": (summarize_stats([s["entropy_sum"] for s in everything],
                                    [s["entropy_tokens"] for s in everything], sum(hists.values()))
                    if cfg.eval.entropy and everything else None) or {},
        "tokens_generated": sum(s["tokens"] for s in everything),
        "timing_s": {"total": time.perf_counter() - t_start, **{k: float(v) for k, v in seconds.items()}},
        "sandbox": isolation() if "mbpp" in cfg.eval.tasks else None,
        "config": dataclasses.asdict(cfg),
    }
    (run_dir / "results.json").write_text(json.dumps(results, indent=2))
    (run_dir / "results.md").write_text(results_markdown(results))
    if cfg.eval.save_samples:
        with open(run_dir / "samples.jsonl", "w") as f:
            for name in cfg.eval.tasks:
                for s in sorted(samples[name], key=lambda s: (s["problem"], s["sample"])):
                    f.write(json.dumps({"task": name, **s}) + "\n")
    results["run_dir"] = str(run_dir)
    return results


# -- es-drift -----------------------------------------------------------------------------------------------


def _tensor_index(model_dir: Path) -> dict[str, Path]:
    from safetensors import safe_open

    from es_ray.models import ModelNotFoundError

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{model_dir} holds no *.safetensors files")
    index = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            index.update({k: f for k in sf.keys()})
    return index


def run_drift(cfg: DriftConfig) -> dict:
    """drift.json and drift_hist.png for base -> tuned, streaming one tensor pair at a time."""
    from safetensors import safe_open

    from es_ray.eval.drift import drift
    from es_ray.eval.plots import plot_update_histograms
    from es_ray.models import resolve_model

    base_dir, tuned_dir = resolve_model(cfg.base), resolve_model(cfg.tuned)
    base_idx, tuned_idx = _tensor_index(base_dir), _tensor_index(tuned_dir)
    common = sorted(set(base_idx) & set(tuned_idx))
    with ExitStack() as stack:
        handles: dict[Path, object] = {}

        def get(index: dict[str, Path], name: str):
            f = index[name]
            if f not in handles:
                handles[f] = stack.enter_context(safe_open(str(f), framework="pt"))
            return handles[f].get_tensor(name)

        report = drift(((n, get(base_idx, n), get(tuned_idx, n)) for n in common),
                       thresholds=cfg.thresholds, top=cfg.top)
    report.update(base=str(base_dir), tuned=str(tuned_dir),
                  missing={"base_only": sorted(set(base_idx) - set(tuned_idx)),
                           "tuned_only": sorted(set(tuned_idx) - set(base_idx))})
    from es_ray.driver import make_run_dir

    run_dir = make_run_dir(cfg, prefix="drift")  # run.dir, else <run.root>/drift-<timestamp>
    (run_dir / "drift.json").write_text(json.dumps(report, indent=2))
    plot_update_histograms(report, run_dir / "drift_hist.png", title=f"{Path(str(tuned_dir)).name} vs base")
    report["run_dir"] = str(run_dir)
    return report


def drift_summary(report: dict) -> str:
    t = report["thresholds"]
    lines = [f"{'module type':<12} {'tensors':>7} {'L2':>10} {'rel L2':>9} {'nonzero':>8} "
             + " ".join(f"{'<' + format(x, 'g'):>8}" for x in t) + f" {'max |d|':>9}"]
    rows = list(report["by_module_type"].items()) + [("total", report["total"])]
    for kind, r in rows:
        rel = "-" if r["relative_l2"] is None else f"{r['relative_l2']:.2e}"
        share = " ".join("       -" if r["share_below"][f"{x:g}"] is None else f"{r['share_below'][f'{x:g}']:>8.1%}"
                         for x in t)
        nz = "-" if r["share_nonzero"] is None else f"{r['share_nonzero']:.1%}"
        lines.append(f"{kind:<12} {r['tensors']:>7} {r['l2']:>10.3e} {rel:>9} {nz:>8} {share} {r['max_abs']:>9.2e}")
    return "\n".join(lines)


# -- entry points -------------------------------------------------------------------------------------------


def _fail(prog: str, exc: Exception) -> None:
    print(f"{prog}: {type(exc).__name__}: {exc}", file=sys.stderr)
    raise SystemExit(2) from None


def _eval_main(dict_cfg) -> None:
    from es_ray.config import ConfigError, to_config, validate_eval
    from es_ray.models import ModelNotFoundError
    from es_ray.tasks.base import TaskLoadError

    try:
        cfg = validate_eval(to_config(dict_cfg, EvaluateConfig))
        results = run(cfg)
    except (ConfigError, ModelNotFoundError, TaskLoadError) as exc:
        _fail("es-eval", exc)
    print((Path(results["run_dir"]) / "results.md").read_text())
    print(f"es-eval: results in {results['run_dir']}")


def _drift_main(dict_cfg) -> None:
    from es_ray.config import ConfigError, to_config, validate_drift
    from es_ray.models import ModelNotFoundError

    try:
        cfg = validate_drift(to_config(dict_cfg, DriftConfig))
        report = run_drift(cfg)
    except (ConfigError, ModelNotFoundError) as exc:
        _fail("es-drift", exc)
    print(drift_summary(report))
    print(f"es-drift: drift.json and drift_hist.png in {report['run_dir']}")


def _hydra(config_name: str, fn, prog: str, register=None) -> None:
    import hydra

    from es_ray.config import register_configs

    (register or register_configs)()
    if not CONF_DIR.is_dir():
        raise SystemExit(f"{prog}: Hydra presets not found at {CONF_DIR}; install the project with `pip install -e .`")
    hydra.main(config_path=str(CONF_DIR), config_name=config_name, version_base="1.3")(fn)()


def main() -> None:
    _hydra("es_eval", _eval_main, "es-eval")


def drift_main() -> None:
    _hydra("es_drift", _drift_main, "es-drift")


if __name__ == "__main__":
    main()
