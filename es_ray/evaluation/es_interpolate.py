"""`es-interpolate`: reward and pass@k along the straight path between two solutions.

    es-interpolate a=/abs/es/checkpoints/final b=/abs/grpo/checkpoints/final eval.tasks=[gsm8k] eval.n=8 eval.k=[1,8]
    es-interpolate a= b=/abs/es/checkpoints/final grid=[0,0.1,0.2,0.5,1]          (a empty: the base model)

At each t of the grid the engine's weights are rewritten to theta(t) = (1 - t) theta_a + t theta_b one tensor at a
time (read a's and b's tensor, mix in fp32, write, drop), so no second model is ever held; every t scores the same
problems with the same sampling seeds (es-eval's chunks), so t = 0 and t = 1 score exactly what es-eval gives a and
b. Reported per task and metric: the curve, the barrier (the largest drop below the straight line between the end
points) with its bootstrap interval over problems, and the cosine between the updates theta_a - theta_0 and
theta_b - theta_0, overall and per module type (es_ray.metrics.interpolate; docs/evaluation.md).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np

from es_ray.evaluation.compat import check_same_architecture
from es_ray.evaluation.config import EvalJobConfig, InterpolateJobConfig, register_configs, to_interpolate_config
from es_ray.evaluation.worker import EvalWorker, load_eval_task, plan_chunks
from es_ray.metrics.passk import pass_at_k
from es_ray.models import read_tensor, resolve_model, safetensors_index
from es_ray.runtime.entry import TRAINING_RUN_KEYS, hydra_main, run_or_exit
from es_ray.runtime.rundir import open_run_dir, releases_run_dir

# The torch-backed interpolation metrics are imported where the path is scored: --help and a config error need no torch.


def _weights(index_a: dict, index_b: dict, t: float):
    """(name, theta(t)) one tensor at a time."""
    from es_ray.metrics.interpolate import mix

    for name, (file_a, _) in index_a.items():
        yield name, mix(read_tensor(file_a, name), read_tensor(index_b[name][0], name), t)


def update_cosines(base_dir: Path, a_dir: Path, b_dir: Path) -> dict:
    from es_ray.metrics.interpolate import UpdateCosine

    i0, ia, ib = safetensors_index(base_dir), safetensors_index(a_dir), safetensors_index(b_dir)
    acc = UpdateCosine()
    for name, (file_a, _) in ia.items():
        acc.add(name, read_tensor(i0[name][0], name), read_tensor(file_a, name), read_tensor(ib[name][0], name))
    return acc.result()


def per_problem_scores(samples: list[dict], n: int, ks: list[int]) -> dict[str, np.ndarray]:
    """[P] per-problem mean reward and pass@k (problems in order)."""
    by_problem: dict[int, list[dict]] = {}
    for s in samples:
        by_problem.setdefault(s["problem"], []).append(s)
    problems = [by_problem[p] for p in sorted(by_problem)]
    out = {"mean_reward": np.array([np.mean([s["score"] for s in ss]) for ss in problems])}
    for k in ks:
        out[f"pass@{k}"] = np.array([pass_at_k(n, sum(bool(s["correct"]) for s in ss), k) for ss in problems])
    return out


@releases_run_dir
def run(cfg: InterpolateJobConfig) -> dict:
    from es_ray.metrics.interpolate import barrier, barrier_interval

    t_start = time.perf_counter()
    base_dir = resolve_model(cfg.base)
    a_dir = resolve_model(cfg.a) if cfg.a else base_dir
    b_dir = resolve_model(cfg.b) if cfg.b else base_dir
    # refused in one line before any model loads: different architectures, tokenizers or tensors
    check_same_architecture(a_dir, b_dir, "a", "b")
    check_same_architecture(base_dir, a_dir, "base", "a")
    eval_cfg = EvalJobConfig(
        eval=dataclasses.replace(cfg.eval, entropy=False, save_samples=False, kl_base=False),
        engine=cfg.engine,
        run=cfg.run,
    )
    eval_cfg.model.path = str(a_dir)
    sizes = {name: len(load_eval_task(eval_cfg, name)[1]) for name in cfg.eval.tasks}
    run_dir = open_run_dir(cfg, "interpolate")
    cosines = update_cosines(base_dir, a_dir, b_dir)
    chunks = plan_chunks(eval_cfg, sizes)  # the same chunks and seeds at every t
    worker = EvalWorker(eval_cfg)
    index_a, index_b = safetensors_index(a_dir), safetensors_index(b_dir)
    ks = list(cfg.eval.k)
    values: dict[str, dict[str, list[np.ndarray]]] = {name: {} for name in cfg.eval.tasks}
    for t in cfg.grid:
        worker.engine.write_weights(_weights(index_a, index_b, float(t)))
        samples: dict[str, list[dict]] = {name: [] for name in cfg.eval.tasks}
        for chunk in chunks:
            samples[chunk.task].extend(worker.run_chunk(chunk)["samples"])
        for name in cfg.eval.tasks:
            for metric, v in per_problem_scores(samples[name], cfg.eval.n, ks).items():
                values[name].setdefault(metric, []).append(v)
    tasks = {}
    for name, metrics in values.items():
        tasks[name] = {}
        for metric, rows in metrics.items():
            v_tp = np.stack(rows)
            curve = v_tp.mean(axis=1)
            height, at = barrier(curve, cfg.grid)
            lo, hi = barrier_interval(v_tp, cfg.grid, cfg.draws, seed=cfg.run.seed)
            tasks[name][metric] = {
                "curve": curve.tolist(),
                "barrier": height,
                "barrier_at": at,
                "barrier_interval": [lo, hi],
                "problems": int(v_tp.shape[1]),
            }
    results = {
        "a": cfg.a or "base",
        "b": cfg.b or "base",
        "base": cfg.base or "embedded SmolLM2-135M-Instruct",
        "grid": list(cfg.grid),
        "tasks": tasks,
        "updates": cosines,
        "settings": {
            "n": cfg.eval.n,
            "k": ks,
            "temperature": cfg.eval.temperature,
            "top_p": cfg.eval.top_p,
            "max_new_tokens": cfg.eval.max_new_tokens,
            "limit": cfg.eval.limit,
            "seed": cfg.run.seed,
            "draws": cfg.draws,
        },
        "timing_s": {"total": time.perf_counter() - t_start},
        "config": dataclasses.asdict(cfg),
    }
    (run_dir / "interpolation.json").write_text(json.dumps(results, indent=2))
    (run_dir / "interpolation.md").write_text(markdown(results))
    results["run_dir"] = str(run_dir)
    return results


def markdown(results: dict) -> str:
    grid = results["grid"]
    lines = [
        f"# Interpolation a={results['a']} -> b={results['b']}",
        "",
        "| task | metric | " + " | ".join(f"t={t:g}" for t in grid) + " | barrier [95% CI] |",
        "|---|---|" + "---|" * len(grid) + "---|",
    ]
    for name, metrics in results["tasks"].items():
        for metric, r in metrics.items():
            lo, hi = r["barrier_interval"]
            at = "no drop" if r["barrier_at"] is None else f"at t={r['barrier_at']:g}"
            lines.append(
                f"| {name} | {metric} | "
                + " | ".join(f"{v:.3f}" for v in r["curve"])
                + f" | {r['barrier']:.3f} [{lo:.3f}, {hi:.3f}] {at} |"
            )
    lines += [
        "",
        "Barrier: the largest drop of the score m(t) below the straight line between the end points, "
        "max over interior t of (1 - t) m(0) + t m(1) - m(t), with the t where it is largest; 0 with \"no drop\" "
        "when no interior point lies below the line (the end points lie on it by construction). The 95% "
        "interval resamples the problems, one draw shared by every t.",
    ]
    u = results["updates"]
    show = lambda c: "n/a (an update is zero)" if c is None else f"{c:.4f}"  # noqa: E731
    lines += [
        "",
        f"cosine(theta_a - theta_0, theta_b - theta_0): {show(u['cosine'])}",
        "",
        "| module type | cosine |",
        "|---|---|",
    ]
    lines += [f"| {k} | {show(c)} |" for k, c in u["by_module_type"].items()]
    return "\n".join(lines) + "\n"


def _main(dict_cfg) -> None:
    results = run_or_exit("es-interpolate", lambda: run(to_interpolate_config(dict_cfg)))
    print((Path(results["run_dir"]) / "interpolation.md").read_text())
    print(f"es-interpolate: results in {results['run_dir']}")


def main() -> None:
    hydra_main("es_interpolate", _main, "es-interpolate", register_configs, unread=(*TRAINING_RUN_KEYS, "run.trackers"))


if __name__ == "__main__":
    main()
