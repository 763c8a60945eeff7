"""`es-compare`: the paper's comparison in one command: base, ES, GRPO, ES->GRPO and GRPO->ES, with a report.

    es-compare experiment=cpu_demo
    es-compare experiment=paper_easy model=qwen2.5-1.5b cluster=gpu8 run.dir=/shared/runs/cmp-qwen
    es-compare experiment=cpu_demo methods=[base,es] budget.epochs=4 run.dir=/abs/cmp

Budgets are matched by the number of training prompts seen, in epochs over the training pool (the paper's
unit): ES runs ``epochs * pool / es.prompts_per_iteration`` iterations, GRPO ``epochs * pool /
grpo.prompts_per_step`` steps; in ES->GRPO and GRPO->ES each half gets half the epochs and the second starts from
the first's final checkpoint. With budget.unit=tokens or device_seconds each run stops at the step landing
closest to its budget, and the report says what each reached (matched only within budget.tolerance). Every
method is evaluated with the same es-eval settings (tasks, n, k, sampling, seed) and compared with the base
weights (es-drift).

The work is cut into stages (a training run, an evaluation, a drift report), each in its own directory under
``run.dir/stages``; a finished stage writes ``done.json`` and is never run again, so repeating the command after an
interruption finishes only what is missing (a stage cut off midway is started again from its beginning). Training
and evaluation run as Ray actors on the cluster (``cluster.address``), exactly as es-train, grpo-train and
es-eval do; this process only orchestrates and writes report.md, report.json and the plots.

The schema and its checks are launch/compare/config.py, the stages (each one's config and job) stages.py; this
module runs them once each and in order, writes the report and is the command.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable

from es_ray.core.config import ConfigError, to_config
from es_ray.launch.compare import sensitivity
from es_ray.launch.compare.config import (
    BUDGET_UNITS,
    BudgetConfig,
    CompareConfig,
    InterpolationConfig,
    pool_size,
    training_tasks,
    validate_compare,
    validate_sequence,
)
from es_ray.launch.compare.methods import METHODS, TRAINED, budget_units
from es_ray.launch.compare.stages import PART_STAGES, Stage, final_weights, interpolation_plan, stage_plan
from es_ray.models import resolve_model
from es_ray.runtime import cluster
from es_ray.runtime.entry import hydra_main, run_or_exit
from es_ray.runtime.rundir import RESULT_NEUTRAL, changed_settings, claim_run_dir, move_aside
from es_ray.runtime.tracking import log_summary

__all__ = [
    "BUDGET_UNITS",
    "METHODS",
    "BudgetConfig",
    "CompareConfig",
    "InterpolationConfig",
    "Stage",
    "budget_units",
    "check_stage_memory",
    "claim_compare_dir",
    "done_record",
    "final_weights",
    "interpolation_plan",
    "main",
    "pool_size",
    "register_configs",
    "run",
    "run_stage",
    "stage_plan",
    "stage_settings",
    "to_compare_config",
    "tracker_metrics",
    "training_tasks",
    "validate_compare",
    "validate_sequence",
]
"""The run's own names and, re-exported, the config's and the stages' that callers and tests import from here."""

# The memory plan, the report and the --plan estimate (and Hydra) are imported where they run: es-compare's --help
# and a config error start about 0.3 s sooner without them.


def check_stage_memory(cfg: CompareConfig) -> None:
    """Every stage's memory plan against the devices it will run on, before any work (run dir, model, Ray). Not part
    of validate_compare: a preset composes on any machine; it is the run that must fit the one it starts on."""
    from es_ray.memory_plan import model_shape, startup_check

    shape = model_shape(cfg.model.path)  # later stages start from checkpoints of the same shape
    if shape is None:
        return
    for method in cfg.methods:
        for spec in stage_plan(cfg, method, Path("/tmp"), seed=cfg.seeds[0]):
            kind = {"train_es": "es", "train_grpo": "grpo", "eval": "eval", "seq_eval": "eval"}.get(spec.kind)
            if kind:
                startup_check(kind, spec.config(), shape=shape)


def _json_safe(x):
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x if isinstance(x, (str, int, float, bool)) or x is None else str(x)


def run_stage(stage: Stage, root: Path, log: Callable[[str], None]) -> dict:
    """Run one stage unless its done.json exists; a directory without it is a cut-off attempt and is cleared."""
    d = stage.dir(root)
    done = d / "done.json"
    settings = stage_settings(stage.config())
    record = done_record(stage, root, settings)
    if record is not None:
        log(f"{stage.name}: done earlier, skipped")
        return record
    if d.exists():
        log(f"{stage.name}: an earlier attempt did not finish; starting it again")
        shutil.rmtree(d)
    log(f"{stage.name}: running")
    t0 = time.perf_counter()
    out = stage.run(stage.config())
    record = {
        "stage": stage.name,
        "kind": stage.kind,
        "seconds": time.perf_counter() - t0,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "result": _json_safe(_stage_result(stage, out)),
        "settings": settings,
    }
    tmp = d / "done.json.tmp"
    tmp.write_text(json.dumps(record, indent=2))
    tmp.replace(done)
    log(f"{stage.name}: finished in {record['seconds']:.0f} s")
    return record


def done_record(stage: Stage, root: Path, settings: dict | None = None) -> dict | None:
    """The stage's done.json (None: not done); one done with other settings than this command's is refused."""
    done = stage.dir(root) / "done.json"
    if not done.is_file():
        return None
    record = json.loads(done.read_text())
    now = stage_settings(stage.config()) if settings is None else settings
    # a record without settings (written before they were kept) is trusted as it is; a key only one side has is a
    # change (a stage's settings come from one version of this code)
    before = record.get("settings")
    changed = [] if before is None else changed_settings(before, now, RESULT_NEUTRAL, missing=True)
    if changed:
        raise ConfigError(
            f"{stage.name} in {root} was done with other settings ({', '.join(changed[:8])}); its results would "
            f"not match this command. Use a new run.dir (or run.overwrite=true to move this comparison aside), or "
            f"delete {stage.dir(root)} to redo that stage (and the stages after it that use its checkpoint)"
        )
    return record


def claim_compare_dir(root: Path, cfg: CompareConfig, log: Callable[[str], None]) -> None:
    """Repeating a comparison's command continues it (its finished stages are checked against this command before
    any work: ``done_record``); run.overwrite=true moves an earlier comparison aside first, and a run.dir holding
    another kind of run is refused."""
    if not (root / "compare_config.json").is_file():
        claim_run_dir(root, cfg.run.overwrite, "compare")  # an es-train/grpo-train/es-eval run there
    elif cfg.run.overwrite:
        log(f"es-compare: run.overwrite=true: the comparison that was in {root} is now in {move_aside(root)}")


def stage_settings(stage_cfg) -> dict:
    """The stage's full configuration, flattened to dotted keys, without the keys that cannot change results."""
    flat: dict = {}

    def walk(prefix: str, x) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                walk(f"{prefix}{k}.", v)
        else:
            flat[prefix[:-1]] = x

    walk("", _json_safe(dataclasses.asdict(stage_cfg)))
    return {k: v for k, v in flat.items() if k not in RESULT_NEUTRAL and not k.startswith("faults.")}


def _stage_result(stage: Stage, out: dict) -> dict:
    if stage.kind.startswith("train"):
        return {"run_dir": out.get("run_dir"), "final_checkpoint": out.get("final_checkpoint")}
    return {"run_dir": out.get("run_dir")}


def run(cfg: CompareConfig, log: Callable[[str], None] = print) -> dict:
    from es_ray.launch.compare.report import write_report

    if not cfg.run.dir:
        raise ConfigError(
            "run.dir= is required: the comparison's absolute directory (repeat the command with the "
            "same run.dir to resume it)"
        )
    root = Path(cfg.run.dir).expanduser().resolve()
    check_stage_memory(cfg)
    claim_compare_dir(root, cfg, log)
    root.mkdir(parents=True, exist_ok=True)
    resolve_model(cfg.model.path)  # converts the embedded model once, before any stage starts
    pools = {t: pool_size(cfg, t) for t in training_tasks(cfg)}
    pool = pools[training_tasks(cfg)[0]]
    plan = {m: {s: stage_plan(cfg, m, root, pools, s) for s in cfg.seeds} for m in cfg.methods}
    paths = {s: interpolation_plan(cfg, root, s) for s in cfg.seeds}
    sens = sensitivity.plan(cfg, root, pools, stage_plan)  # short runs at other step sizes, after the report
    every = [st for by_seed in plan.values() for stages in by_seed.values() for st in stages]
    for stage in every + [st for stages in paths.values() for st in stages]:
        done_record(stage, root)  # a finished stage with other settings: refused before any work
    for _, vroot, stages in sens:
        for stage in stages:
            done_record(stage, vroot)
    (root / "compare_config.json").write_text(json.dumps(_json_safe(dataclasses.asdict(cfg)), indent=2))
    cluster.connect(cfg.cluster)
    # seed by seed, so an interrupted comparison has whole seeds; a seed's paths after its methods' stages
    order = [st for seed in cfg.seeds for st in [st for m in cfg.methods for st in plan[m][seed]] + paths[seed]]
    if "base" in plan:  # the base evaluation first, to measure completion lengths
        first = plan["base"][cfg.seeds[0]]
        order = first + [st for st in order if st not in first]
    checked = "base" not in plan or cfg.budget.unit != "tokens"
    for i, stage in enumerate(order):
        if stage.kind.startswith("train") and not checked:
            measured = check_reach_measured(cfg, root, plan, pools)
            log(
                f"es-compare: budget.tokens={cfg.budget.tokens} reachable by every method at the base model's "
                f"measured {measured:.1f} tokens per completion"
            )
            checked = True
        run_stage(stage, root, lambda line, i=i: log(f"es-compare: stage {i + 1}/{len(order)} {line}"))
    report = write_report(root, cfg, plan, pool, paths)
    report["sensitivity"] = sensitivity.run(cfg, sens, report, root, log, run_stage)
    log_summary(root, cfg, tracker_metrics(report), "es-compare")
    log(f"es-compare: done; report in {root / 'report.md'} (report.json and the plots beside it)")
    return report


def check_reach_measured(cfg: CompareConfig, root: Path, plan: dict, pools: dict[str, int]) -> float:
    """The token budget's reachability at the base model's measured mean completion length (its evaluation's
    results.json), before any training; returns that length. ``pools``: each training task's pool."""
    res = json.loads((plan["base"][cfg.seeds[0]][-1].dir(root) / "results.json").read_text())
    lengths = [t["tokens"]["mean_per_completion"] for t in res["tasks"].values()]
    measured = sum(lengths) / len(lengths)
    for method in cfg.methods:
        parts = TRAINED.get(method, ())
        for part in parts:
            make = PART_STAGES[part][0]
            for task in cfg.sequence or [""]:
                make(
                    cfg,
                    cfg.model.path,
                    root / "stages" / "check",
                    cfg.budget.epochs / len(parts),
                    pools[task or cfg.task.name],
                    cfg.seeds[0],
                    measured,
                    task=task,
                )
    return measured


_LEDGER_METRICS = (
    "tokens_generated",
    "tokens_backpropagated",
    "wall_s",
    "startup_s",
    "device_s",
    "peak_rss_bytes_max",
    "peak_gpu_bytes_max",
)


def tracker_metrics(report: dict) -> dict[str, float]:
    """The report's numbers per method under the names every tracker gets: compare/<method>/pass_at_<k> (mean over
    the tasks), entropy, drift_l2, the measured ledger and (eval.kl_base) kl_base_tuned / kl_tuned_base (mean over
    the tasks)."""
    out = {}
    for method, m in report["methods"].items():
        out.update({f"compare/{method}/pass_at_{k}": v for k, v in m["average"].items()})
        out[f"compare/{method}/entropy"] = m["entropy"]["mean_per_token"]
        out[f"compare/{method}/drift_l2"] = (m.get("drift") or {}).get("l2")
        out.update({f"compare/{method}/{k}": (m["ledger"] or {}).get(k) for k in _LEDGER_METRICS})
    for method, by_task in ((report.get("kl") or {}).get("methods") or {}).items():  # eval.kl_base: over the tasks
        for d in ("base_tuned", "tuned_base"):
            v = [c[d]["mean"] for c in by_task.values() if c[d]["mean"] is not None]
            out[f"compare/{method}/kl_{d}"] = sum(v) / len(v) if v else None
    return {k: v for k, v in out.items() if v is not None}


# -- entry point ------------------------------------------------------------------------------------------------


def register_configs() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="es_compare_schema", node=CompareConfig)


def to_compare_config(dict_cfg: Any) -> CompareConfig:
    return validate_compare(to_config(dict_cfg, CompareConfig))


def _main(dict_cfg) -> None:
    run_or_exit("es-compare", lambda: run(to_compare_config(dict_cfg)))  # its last line names the report


def plan_main(dict_cfg) -> None:
    """es-compare --plan: the primary family's seeds, problems and compute (launch/compare/plan.py), no spend."""
    from es_ray.launch.compare.plan import plan

    run_or_exit("es-compare --plan", lambda: plan(to_compare_config(dict_cfg)))


def main() -> None:
    if "--plan" in sys.argv[1:]:  # the seeds, problems and compute the primary family needs, before any spend
        sys.argv.remove("--plan")
        return hydra_main("es_compare", plan_main, "es-compare --plan", register_configs)
    hydra_main("es_compare", _main, "es-compare", register_configs)


if __name__ == "__main__":
    main()
