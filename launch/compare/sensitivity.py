"""es-compare's sensitivity stage: does the verdict survive the published range of step sizes?

A step size with no source decides the L2 ratio and the budget race by itself (docs/design.md "A fair comparison"),
and published GRPO learning rates differ by an order of magnitude (TRL's and verl's 1e-6, the ES authors' GRPO
baseline 1e-5). With ``sensitivity.grpo.lr=[...]`` / ``sensitivity.es.sigma=[...]`` / ``sensitivity.es.lr=[...]``
es-compare runs, after the main stages, one short run per value (``sensitivity.share`` of the budget, the first
seed), each trained, evaluated and measured for drift like a main stage, plus a short run of each method at the
preset's own settings to set them against. ``sensitivity.md`` (appended to report.md) and ``sensitivity.json`` say,
per value, the difference ES - GRPO at the first k beside the preset pair's, whether its sign is the main report's,
and the L2 ratio with both methods' step sizes. One seed per value: a direction, not a test (the main report's
paired tests are the verdict); the report says so.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from es_ray.core.config import ConfigError


@dataclass
class GRPOSweep:
    lr: list[float] = field(default_factory=list)
    """grpo.lr values, one short GRPO run each (e.g. [1e-6, 3e-6, 1e-5]: TRL's and verl's default up to the ES
    authors' GRPO baseline). Empty: none."""


@dataclass
class ESSweep:
    sigma: list[float] = field(default_factory=list)
    """es.sigma values, one short ES run each, at the preset's alpha = es.lr / es.sigma (so es.lr = alpha * sigma:
    the reference's convention, docs/es-update.md). Empty: none."""
    lr: list[float] = field(default_factory=list)
    """es.lr values at the preset's es.sigma, one short ES run each. Empty: none."""


@dataclass
class SensitivityConfig:
    """Short runs at other step sizes after the main stages (launch/compare/sensitivity.py; docs/comparison.md)."""

    grpo: GRPOSweep = field(default_factory=GRPOSweep)
    es: ESSweep = field(default_factory=ESSweep)
    share: float = 0.25
    """Each short run's share of the main budget (budget.epochs, budget.tokens or budget.device_seconds alike)."""


@dataclass(frozen=True)
class Variant:
    """One short run: ``method`` with ``key`` set to ``value`` ("preset": the preset's own settings)."""

    method: str
    key: str
    value: float | None
    cfg: object
    """The variant's CompareConfig (the main one with the value and the short budget)."""

    @property
    def name(self) -> str:
        return "preset" if self.value is None else f"{self.key}={self.value:g}"


def enabled(cfg) -> bool:
    s = cfg.sensitivity
    return bool(s.grpo.lr or s.es.sigma or s.es.lr)


def validate_sensitivity(cfg) -> None:
    """Positive values, a share in (0, 1], and both methods run (a value is judged against the other method)."""
    s = cfg.sensitivity
    lists = (("sensitivity.grpo.lr", s.grpo.lr), ("sensitivity.es.sigma", s.es.sigma), ("sensitivity.es.lr", s.es.lr))
    for key, values in lists:
        example = f"(e.g. {key}=[1e-6,3e-6,1e-5])"
        if not isinstance(values, (list, tuple)):
            raise ConfigError(f"{key}={values!r} must be a list of step sizes {example}")
        if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in values):
            raise ConfigError(f"{key}={list(values)}: every value must be a number {example}")
        if not all(v > 0 for v in values):
            raise ConfigError(f"{key}={list(values)}: every value must be > 0 {example}")
        if not all(math.isfinite(v) for v in values):
            raise ConfigError(f"{key}={list(values)}: every value must be a finite number {example}")
        if len(set(values)) < len(values):  # two short runs of one value would share one directory
            raise ConfigError(f"{key}={list(values)} repeats a value: list each step size once")
    if not 0 < s.share <= 1:
        raise ConfigError(f"sensitivity.share={s.share} must be in (0, 1]: each short run's share of the budget")
    if enabled(cfg) and not {"es", "grpo"} <= set(cfg.methods):
        named = ", ".join(key for key, values in lists if values)
        raise ConfigError(
            f"sensitivity.* needs methods to include es and grpo (methods={list(cfg.methods)}; set: "
            f"{named}): each value is judged against the other method; add them or clear those lists"
        )


def _short(cfg, **sections):
    b = cfg.budget
    share = cfg.sensitivity.share
    budget = dataclasses.replace(
        b, epochs=b.epochs * share, tokens=int(b.tokens * share), device_seconds=b.device_seconds * share
    )
    return dataclasses.replace(
        cfg, budget=budget, seeds=[cfg.seeds[0]], interpolate=dataclasses.replace(cfg.interpolate, pairs=[]), **sections
    )


def variants(cfg) -> list[Variant]:
    """The short runs: each method at the preset's settings, then every swept value."""
    if not enabled(cfg):
        return []
    s, es = cfg.sensitivity, cfg.es
    alpha = es.lr / es.sigma
    out = [Variant(m, "preset", None, _short(cfg)) for m in ("es", "grpo")]
    out += [Variant("grpo", "grpo.lr", v, _short(cfg, grpo=dataclasses.replace(cfg.grpo, lr=v))) for v in s.grpo.lr]
    out += [
        Variant("es", "es.sigma", v, _short(cfg, es=dataclasses.replace(es, sigma=v, lr=alpha * v))) for v in s.es.sigma
    ]
    out += [Variant("es", "es.lr", v, _short(cfg, es=dataclasses.replace(es, lr=v))) for v in s.es.lr]
    return out


def plan(cfg, root: Path, pools: dict[str, int], stage_plan: Callable) -> list[tuple[Variant, Path, list]]:
    """(variant, its own root under run.dir/sensitivity, its stages) for every short run; ``stage_plan`` is
    es-compare's (launch/compare/stages.py, passed in by launch/compare/run.py)."""
    out = []
    for v in variants(cfg):
        vroot = root / "sensitivity" / (f"{v.method}.preset" if v.value is None else v.name)
        out.append((v, vroot, stage_plan(v.cfg, v.method, vroot, pools, v.cfg.seeds[0])))
    return out


def run(cfg, planned: list, report: dict, root: Path, log: Callable[[str], None], run_stage: Callable) -> dict | None:
    """Run the short runs not done yet (each stage resumes as a main stage does: es-compare's ``run_stage``), then
    write sensitivity.json and sensitivity.md and append the latter to report.md. Returns the summary (None when no
    sweep is set)."""
    if not planned:
        return None
    for i, (v, vroot, stages) in enumerate(planned):
        for stage in stages:
            run_stage(
                stage,
                vroot,
                lambda line, i=i: log(f"es-compare: sensitivity {i + 1}/{len(planned)} {v.method} {v.name}: {line}"),
            )
    summary = summarise(cfg, planned, report)
    (root / "sensitivity.json").write_text(json.dumps(summary, indent=2))
    text = "\n".join(markdown(summary)) + "\n"
    (root / "sensitivity.md").write_text(text)
    with open(root / "report.md", "a") as f:
        f.write("\n" + text)
    return summary


def _outcome(cfg, v: Variant, vroot: Path, stages: list) -> dict:
    ev = json.loads((stages[[s.kind for s in stages].index("eval")].dir(vroot) / "results.json").read_text())
    k = str(min(int(x) for x in cfg.eval.k))
    tasks = list(cfg.eval.tasks)
    drift = next((s for s in stages if s.kind == "drift"), None)
    l2 = json.loads((drift.dir(vroot) / "drift.json").read_text())["total"]["l2"] if drift else None
    return {
        "method": v.method,
        "key": v.key,
        "value": v.value,
        "name": v.name,
        "k": int(k),
        "pass_at_k": sum(ev["tasks"][t]["pass@k"][k] for t in tasks) / len(tasks),
        "drift_l2": l2,
        "step_sizes": step_sizes(v.cfg),
    }


def summarise(cfg, planned: list, report: dict) -> dict:
    """Per swept value: its pass@k (the first k, averaged over the tasks), the other method's at the preset, the
    difference ES - GRPO and whether its sign is the main report's and the preset pair's, and the L2 ratio."""
    runs = [_outcome(cfg, v, vroot, stages) for v, vroot, stages in planned]
    preset = {r["method"]: r for r in runs if r["key"] == "preset"}
    k = str(runs[0]["k"])
    main = {m: ((report.get("methods") or {}).get(m) or {}).get("average", {}).get(k) for m in ("es", "grpo")}
    main_diff = main["es"] - main["grpo"] if None not in main.values() else None
    short_diff = preset["es"]["pass_at_k"] - preset["grpo"]["pass_at_k"]
    rows = []
    for r in runs:
        if r["key"] == "preset":
            continue
        es, grpo = (r, preset["grpo"]) if r["method"] == "es" else (preset["es"], r)
        diff = es["pass_at_k"] - grpo["pass_at_k"]
        ratio = es["drift_l2"] / grpo["drift_l2"] if es["drift_l2"] and grpo["drift_l2"] else None
        rows.append(
            {
                **r,
                "es_minus_grpo": diff,
                "same_sign_as_main": _same_sign(diff, main_diff),
                "same_sign_as_preset_pair": _same_sign(diff, short_diff),
                "l2_ratio_es_over_grpo": ratio,
                "es_step_sizes": es["step_sizes"]["es"],
                "grpo_step_sizes": grpo["step_sizes"]["grpo"],
            }
        )
    return {
        "k": int(k),
        "share": cfg.sensitivity.share,
        "seed": cfg.seeds[0],
        "main_es_minus_grpo": main_diff,
        "preset_pair": {"es_minus_grpo": short_diff, "es": preset["es"], "grpo": preset["grpo"]},
        "rows": rows,
        "survives": all(r["same_sign_as_preset_pair"] is not False for r in rows),
    }


def _same_sign(a: float, b: float | None) -> bool | None:
    if b is None:
        return None
    return (a > 0) == (b > 0) and (a < 0) == (b < 0)


def step_sizes(cfg) -> dict:
    """Both methods' step sizes as a report states them beside the L2 ratio: ES's lr, sigma and alpha = lr / sigma
    (the reference's convention) and optimizer; GRPO's AdamW lr, clip and aggregation."""
    es, g = cfg.es, cfg.grpo
    return {
        "es": {
            "lr": es.lr,
            "sigma": es.sigma,
            "alpha": es.lr / es.sigma,
            "optimizer": es.optimizer,
            "population": es.population,
        },
        "grpo": {"lr": g.lr, "optimizer": "adamw", "max_grad_norm": g.max_grad_norm, "loss_type": g.loss_type},
    }


def step_size_text(sizes: dict | None) -> str:
    """One sentence naming both methods' step sizes (the drift table's line beside the L2 ratio)."""
    if not sizes:
        return ""
    es, g = sizes["es"], sizes["grpo"]
    return (
        f"Step sizes: ES lr {es['lr']:.3g} with sigma {es['sigma']:.3g} (alpha = lr / sigma = {es['alpha']:.3g}, "
        f"{es['optimizer']}, population {es['population']}); GRPO AdamW lr {g['lr']:.3g} (grad-norm clip "
        f"{g['max_grad_norm']:g}, {g['loss_type']} aggregation). With AdamW GRPO's per-step move scales with its "
        "lr, so the ratio moves with these; sensitivity.* shows how far."
    )


def _f(x, fmt="{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def markdown(summary: dict) -> list[str]:
    k, p = summary["k"], summary["preset_pair"]
    lines = [
        "## Sensitivity to the step sizes",
        "",
        f"Short runs ({summary['share']:g} of the budget, seed {summary['seed']}), one per value, each against "
        f"the other method's short run at the preset. Preset pair: ES - GRPO pass@{k} "
        f"{_f(p['es_minus_grpo'], '{:+.3f}')} (main report: {_f(summary['main_es_minus_grpo'], '{:+.3f}')}). "
        "One seed per value: a direction, not a test; the verdict is the main report's paired tests.",
        "",
        f"| value | pass@{k} | ES - GRPO | same sign as the preset pair | as the main report | L2 ES / GRPO "
        "| ES lr / sigma | GRPO lr |",
        "|---|---|---|---|---|---|---|---|",
    ]
    yes = {True: "yes", False: "**no**", None: "-"}
    for r in summary["rows"]:
        lines.append(
            f"| {r['key']}={r['value']:g} | {_f(r['pass_at_k'])} | {_f(r['es_minus_grpo'], '{:+.3f}')} | "
            f"{yes[r['same_sign_as_preset_pair']]} | {yes[r['same_sign_as_main']]} | "
            f"{_f(r['l2_ratio_es_over_grpo'], '{:.2f}')} | {r['es_step_sizes']['lr']:.3g} / "
            f"{r['es_step_sizes']['sigma']:.3g} | {r['grpo_step_sizes']['lr']:.3g} |"
        )
    lines += [
        "",
        "The direction survives every value swept."
        if summary["survives"]
        else "The direction does **not** survive every value swept: the verdict depends on the step sizes.",
    ]
    return lines
