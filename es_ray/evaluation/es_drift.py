"""`es-drift`: compare two checkpoints' weights, one tensor pair at a time (es_ray.metrics.drift holds the metrics).

es-drift base=Qwen/Qwen2.5-1.5B-Instruct tuned=/abs/run/checkpoints/final run.dir=/abs/drift
"""

from __future__ import annotations

import json
import sys
from contextlib import ExitStack
from pathlib import Path

from es_ray.core.dtypes import resolve_dtype
from es_ray.evaluation.config import DriftJobConfig, register_configs, to_drift_config
from es_ray.metrics.plots import checkpoint_label, plot_update_histograms
from es_ray.models import resolve_model, safetensors_index
from es_ray.runtime.entry import TRAINING_RUN_KEYS, hydra_main, run_or_exit
from es_ray.runtime.rundir import open_run_dir, releases_run_dir
from es_ray.runtime.tracking import shows_bar

# torch-backed modules (the drift metrics, safetensors) and tqdm are imported when the drift is computed: --help and a
# config error need none of them.


def _tensor_index(model_dir: Path) -> dict[str, Path]:
    return {name: Path(file) for name, (file, _) in safetensors_index(model_dir).items()}


@releases_run_dir
def run_drift(cfg: DriftJobConfig) -> dict:
    """drift.json and drift_hist.png for base -> tuned, streaming one tensor pair at a time."""
    from safetensors import safe_open

    from es_ray.metrics.drift import drift

    base_dir, tuned_dir = resolve_model(cfg.base), resolve_model(cfg.tuned)
    run_dir = open_run_dir(cfg, "drift")  # run.dir, else <run.root>/drift-<timestamp>; another run's is refused
    base_idx, tuned_idx = _tensor_index(base_dir), _tensor_index(tuned_dir)
    common = sorted(set(base_idx) & set(tuned_idx))
    with ExitStack() as stack:
        handles: dict[Path, object] = {}

        def get(index: dict[str, Path], name: str):
            f = index[name]
            if f not in handles:
                handles[f] = stack.enter_context(safe_open(str(f), framework="pt"))
            return handles[f].get_tensor(name)

        cast = resolve_dtype(cfg.cast_dtype, key="cast_dtype") if cfg.cast_dtype else None
        names, bar = common, shows_bar(cfg.run.progress)
        if bar:  # reading and comparing every tensor takes a minute on a 1.5B model
            from tqdm import tqdm

            names = tqdm(common, desc="es-drift", unit="tensor", dynamic_ncols=True, file=sys.stderr)
        report = drift(
            ((n, get(base_idx, n), get(tuned_idx, n)) for n in names), thresholds=cfg.thresholds, top=cfg.top, cast=cast
        )
        if bar:
            names.close()
    report.update(
        base=str(base_dir),
        tuned=str(tuned_dir),
        missing={
            "base_only": sorted(set(base_idx) - set(tuned_idx)),
            "tuned_only": sorted(set(tuned_idx) - set(base_idx)),
        },
    )
    (run_dir / "drift.json").write_text(json.dumps(report, indent=2))
    title = f"updates from base {checkpoint_label(base_dir)} to tuned {checkpoint_label(tuned_dir)}"
    plot_update_histograms(report, run_dir / "drift_hist.png", title=title)
    report["run_dir"] = str(run_dir)
    return report


def drift_summary(report: dict) -> str:
    """The per-module-type table, for the fp32 weights and (when reported) the weights cast to the engine dtype."""
    t = report["thresholds"]
    views = [("fp32", report)] + ([(report["cast"]["dtype"], report["cast"])] if report.get("cast") else [])
    lines = []
    for label, view in views:
        lines.append(
            f"{label + ' weights':<12} {'tensors':>7} {'L2':>10} {'rel L2':>9} {'nonzero':>8} "
            + " ".join(f"{'<' + format(x, 'g'):>8}" for x in t)
            + f" {'max |d|':>9}"
        )
        for kind, r in list(view["by_module_type"].items()) + [("total", view["total"])]:
            rel = "-" if r["relative_l2"] is None else f"{r['relative_l2']:.2e}"
            share = " ".join(
                "       -" if r["share_below"][f"{x:g}"] is None else f"{r['share_below'][f'{x:g}']:>8.1%}" for x in t
            )
            nz = "-" if r["share_nonzero"] is None else f"{r['share_nonzero']:.1%}"
            lines.append(f"{kind:<12} {r['tensors']:>7} {r['l2']:>10.3e} {rel:>9} {nz:>8} {share} {r['max_abs']:>9.2e}")
    return "\n".join(lines)


def _main(dict_cfg) -> None:
    report = run_or_exit("es-drift", lambda: run_drift(to_drift_config(dict_cfg)))
    print(drift_summary(report))
    print(f"es-drift: drift.json and drift_hist.png in {report['run_dir']}")


def main() -> None:
    # a comparison of two checkpoints: no seed, no trackers, nothing to resume or stop early
    hydra_main("es_drift", _main, "es-drift", register_configs, unread=(*TRAINING_RUN_KEYS, "run.seed", "run.trackers"))


if __name__ == "__main__":
    main()
