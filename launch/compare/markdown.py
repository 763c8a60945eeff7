"""es-compare's report.md: the tables (means over seeds), each seed, the paired tests with their power, the budgets
as reached and the verdict, from report.json's data (``es_ray.launch.compare.report.collect``)."""

from __future__ import annotations

import math

from es_ray.launch.compare.analyses import forgetting_markdown, interpolation_markdown, kl_markdown, objectives_markdown
from es_ray.launch.compare.methods import LABELS
from es_ray.launch.compare.verdict import exploratory_note, find_test, head_lines, verdict_line, verdict_section
from es_ray.launch.compare.sensitivity import step_size_text
from es_ray.launch.compare.truncation import truncation_markdown


def _p(x) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}"


def _f(x, fmt="{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def _gib(b) -> str:
    return "-" if not b else f"{b / 2**30:.2f}"


def markdown(rep: dict) -> str:
    ks, tasks, methods = rep["k"], rep["tasks"], rep["methods"]
    e = rep["eval"]
    kk = "/".join(f"Pass@{k}" for k in ks)
    lines = (
        ["# es-compare report", ""]
        + head_lines(rep)
        + verdict_section(rep)
        + [
            "",
            f"Training budget: {_budget(rep['budget'])} per method (unit {rep['budget']['unit']}; pool of "
            f"{rep['pool']} prompts; at most {rep['budget_epochs']:g} epochs; sequential methods: half each). "
            "Evaluation: "
            f"n = {e['n']} samples per problem, temperature {e['temperature']}, top_p {e['top_p']}, "
            f"max_new_tokens {e['max_new_tokens']}, limit {e['limit'] or 'none'}, seed {e['seed']}.",
            "",
            f"## {kk} (%): mean over seeds {rep['seeds']}",
            "",
            "| method | " + " | ".join(tasks) + " | average |",
            "|---|" + "---|" * (len(tasks) + 1),
        ]
    )
    for m in methods.values():
        cells = [" / ".join(_p(m["pass@k"][t][str(k)]) for k in ks) for t in tasks]
        cells.append(" / ".join(_p(m["average"][str(k)]) for k in ks))
        lines.append(f"| {m['label']} | " + " | ".join(cells) + " |")
    lines += truncation_markdown(rep)
    lines += objectives_markdown(rep)
    lines += uncertainty_markdown(rep)
    lines += entropy_markdown(rep)
    lines += drift_markdown(rep)
    lines += kl_markdown(rep) + interpolation_markdown(rep) + forgetting_markdown(rep)
    lines += compute_markdown(rep)
    lines += verdict_markdown(rep)
    return "\n".join(lines)


def entropy_markdown(rep: dict) -> list[str]:
    tasks, methods, e = rep["tasks"], rep["methods"], rep["eval"]
    nucleus = e["top_p"] < 1 and e["temperature"] > 0
    what = (
        f"the top_p = {e['top_p']} nucleus of softmax(logits / {e['temperature']}), renormalised: what was sampled"
        if nucleus
        else f"softmax(logits / {e['temperature']}): what was sampled"
    )
    extra = [f"untruncated at T = {e['temperature']}"] * nucleus + ["T = 1 (the model's own)"]
    lines = [
        "",
        f"## Token entropy (nats per generated token, teacher-forced; {what}; mean over the seeds)",
        "",
        "| method | all tasks | change vs base | " + " | ".join(tasks) + " | " + " | ".join(extra) + " |",
        "|---|---|---|" + "---|" * (len(tasks) + len(extra)),
    ]
    before = rep["entropy_before"]
    for m in methods.values():
        now = m["entropy"]["mean_per_token"]
        delta = "-" if before is None or now is None else f"{now - before:+.3f}"
        beside = ([_f(m["entropy"].get("untruncated"))] if nucleus else []) + [_f(m["entropy"].get("t1"))]
        lines.append(
            f"| {m['label']} | {_f(now)} | {delta} | "
            + " | ".join(_f(m["entropy"]["per_task"][t]) for t in tasks)
            + " | "
            + " | ".join(beside)
            + " |"
        )
    return lines


def drift_markdown(rep: dict) -> list[str]:
    methods, th = rep["methods"], rep["thresholds"]
    lines = [
        "",
        "## Drift from the base weights",
        "",
        "| method | L2 | relative L2 | changed | " + " | ".join(f"\\|d\\| < {t:g}" for t in th) + " | max \\|d\\| |",
        "|---|---|---|---|" + "---|" * len(th) + "---|",
    ]
    for m in methods.values():
        d = m.get("drift")
        if d is None:
            continue
        lines.append(
            f"| {m['label']} | {d['l2']:.4g} | {_f(d['relative_l2'], '{:.3e}')} | "
            f"{_p(d['share_nonzero'])}% | "
            + " | ".join(f"{_p(d['share_below'][f'{t:g}'])}%" for t in th)
            + f" | {d['max_abs']:.3g} |"
        )
        c = d.get("cast")
        if c is not None:
            lines.append(
                f"| {m['label']} (weights in {c['dtype']}) | {c['l2']:.4g} | {_f(c['relative_l2'], '{:.3e}')} "
                f"| {_p(c['share_nonzero'])}% | "
                + " | ".join(f"{_p(c['share_below'][f'{t:g}'])}%" for t in th)
                + f" | {c['max_abs']:.3g} |"
            )
        null = d.get("null")
        if null is not None:
            if null["l2"] is None:
                lines.append(
                    f"| {m['label']}: null model | - | - | - | "
                    + " | ".join("-" for _ in th)
                    + f" | not applicable: {null['why']} |"
                )
            else:
                lines.append(
                    f"| {m['label']}: null model (rewards ignored) | {null['l2']:.4g} | - | - | "
                    + " | ".join(f"{_p(null['share_below'][f'{t:g}'])}%" for t in th)
                    + " | - |"
                )
    ratio = rep["drift_l2_ratio_es_over_grpo"]
    lines += [
        "",
        f"L2 ratio ES / GRPO: {_f(ratio, '{:.2f}')}. {step_size_text(rep.get('step_sizes'))} "
        "The thresholds columns are the share of changed "
        "parameters whose change is below each threshold (functional sparsity). Rows '(weights in bfloat16)' "
        "measure the same two checkpoints cast to the dtype a GPU engine holds: an update below half a ulp of "
        "its weight (|w| / 256 in bf16) vanishes there, so sparsity on fp32 weights can overstate what the "
        "engine sees.",
        "",
        "Null model: with z-scored (or ranked) fitness an SGD step of ES moves every weight by Normal(0, "
        "(lr / (N sigma))^2 sum z^2) whatever the rewards, so T steps are a random walk "
        "(es_ray/metrics/null_drift.py). "
        "A measured L2 or sparsity share close to the null's is set by the step sizes, not by what ES learned.",
        "",
    ] + null_verdict(methods, th)
    return lines


def compute_markdown(rep: dict) -> list[str]:
    ks, methods = rep["k"], rep["methods"]
    lines = (
        ["", f"## Compute ledger (measured; seed {rep['seeds'][0]}'s runs)", ""]
        + budget_markdown(rep)
        + [
            "",
            "| method | tokens generated | tokens back-propagated | wall s | training device-s | start-up device-s "
            "| checkpoint + held-out device-s | peak RSS per process GiB | peak GPU GiB "
            "| held-out pass@1 gained per 1000 device-s |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
    )
    base_p1 = methods.get("base", {}).get("average", {}).get(str(ks[0]))
    for m in methods.values():
        led = m["ledger"]
        if led is None:
            continue
        gain = (
            None
            if base_p1 is None or not led["device_s"]
            else 1000 * (m["average"][str(ks[0])] - base_p1) / led["device_s"]
        )
        apart = led.get("device_s_apart") or {}
        lines.append(
            f"| {m['label']} | {led['tokens_generated']:,} | {led['tokens_backpropagated']:,} | "
            f"{led['wall_s']:.0f} | {_secs(led['device_s'])} {led['device']} | "
            f"{_secs(apart.get('startup'))} | "
            f"{_secs(apart.get('checkpoint', 0.0) + apart.get('held_out', 0.0) if apart else None)} "
            f"| {_gib(led['peak_rss_bytes_max'])} | {_gib(led['peak_gpu_bytes_max'])} | "
            f"{_f(None if gain is None else 100 * gain, '{:+.2f}')} points |"
        )
    lines += ["", compute_answer(methods)]
    if rep.get("grpo_placement"):
        lines += ["", rep["grpo_placement"] + "."]
    lines += [
        "",
        "device-s: for every actor, the devices it held (GPUs, or CPU cores on a CPU-only actor) times the "
        "seconds it was held, summed (es_ray.runtime.ledger, the same code for every method); training "
        "device-s leave out start-up (placing actors, loading models), checkpoint writes and held-out "
        "scoring, shown apart. Peak memory: the largest peak resident set of any actor process of the run "
        "(and its peak GPU allocation).",
        "",
        "Plots: " + ", ".join(f"`{p}`" for p in rep.get("plots", [])),
        "",
    ]
    return lines


def _secs(x) -> str:
    return "-" if x is None else f"{x:.1f}" if x < 100 else f"{x:,.0f}"


def budget_markdown(rep: dict) -> list[str]:
    """The budget each training run reached, every seed: matched within the tolerance, or not, with both figures."""
    b = rep["budget"]
    if b["unit"] == "epochs":
        return [f"Budget: {_budget(b)} per method in prompts seen (every run makes its planned iterations/steps)."]
    unit = "tokens" if b["unit"] == "tokens" else "training device-s"
    lines = [
        f"Budget as reached ({unit}; matched when within +-{100 * b['tolerance']:g}% of the budget; each run "
        "stops at the step that lands closest to it, or at its epoch cap):",
        "",
        "| method | seed | run | budget | reached | reached / budget | matched | stopped by |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for seed, per in rep["per_seed"].items():
        for method, e in per.items():
            br = e.get("budget_reached")
            for part in (br or {}).get("parts", []):
                fmt = "{:,.0f}" if b["unit"] == "tokens" else "{:.1f}"
                lines.append(
                    f"| {LABELS[method]} | {seed} | {part['stage']} | {fmt.format(part['budget'])} | "
                    f"{fmt.format(part['used'])} | {_f(part['ratio'], '{:.2f}')} | "
                    f"{'yes' if part['matched'] else '**not matched**'} | "
                    f"{'**epoch cap** (budget.epochs)' if part['epoch_cap'] else 'budget'} |"
                )
    return lines


def _iv(x) -> str:
    return f"[{_p(x[0])}, {_p(x[1])}]"


def uncertainty_markdown(rep: dict) -> list[str]:
    """Each seed's average pass@k beside the mean and the between-seed sd, and every pair's paired difference
    (exploratory)."""
    ks, seeds, iv = rep["k"], rep["seeds"], rep["intervals"]
    head = [f"seed {s}" for s in seeds]
    lines = [
        "",
        f"## Per seed: average {'/'.join(f'Pass@{k}' for k in ks)} over tasks (%)",
        "",
        "The tables above show the mean over the seeds; each seed's run here, and the 95% bootstrap interval "
        "over problems of the mean (descriptive; differences are tested paired, below).",
        "",
        "| method | " + " | ".join(head) + " | mean +- std | interval over problems |",
        "|---|" + "---|" * (len(seeds) + 2),
    ]
    for method, m in rep["methods"].items():
        per = [" / ".join(_p(rep["per_seed"][str(s)][method]["average"][str(k)]) for k in ks) for s in seeds]
        acr = rep["across_seeds"][method]["average"]
        spread = " / ".join(f"{_p(acr[str(k)]['mean'])} +- {_p(acr[str(k)]['std'])}" for k in ks)
        ivs = " / ".join(_iv(iv[method]["average"][str(k)]) for k in ks) if method in iv else "-"
        lines.append(f"| {m['label']} | " + " | ".join(per) + f" | {spread} | {ivs} |")
    cmp = rep["comparisons"]
    lines += ["", "## Paired differences (first minus second): exploratory", ""]
    if not cmp["tests"]:
        return lines + [f"No paired test: {cmp.get('why', 'fewer than two methods')}.", ""]
    probs = ", ".join(f"{t} {n}" for t, n in rep["problems"].items())
    lines += [
        exploratory_note() + f" Every pair of methods ({cmp['pairs']} pairs) at every k (average pass@k over "
        "the tasks, each task weighted equally) and on the mean token entropy per problem: the paired "
        f"difference over problems (per task: {probs}) with each method's {len(seeds)} seed(s) as a random "
        "effect (crossed random-effects variance, Student's t at Satterthwaite degrees of freedom, "
        "es_ray/metrics/paired.py).",
        "",
        "| compared | metric | difference [95% interval] | seeds | problems |",
        "|---|---|---|---|---|",
    ]
    for t in cmp["tests"]:
        lines.append(
            f"| {LABELS[t['a']]} - {LABELS[t['b']]} | {t['metric']} | {_diff_cell(t)} | "
            f"{t['seeds_a']} / {t['seeds_b']} | {t['problems']} |"
        )
    return lines


def _diff_cell(t: dict) -> str:
    """difference [interval], in points (pass@k) or nats."""
    f = (lambda x: f"{100 * x:+.3g}") if t["metric"] != "entropy" else (lambda x: f"{x:+.3g}")
    return f"{f(t['diff'])} [{f(t['low'])}, {f(t['high'])}]"


def _difference(rep: dict, a: str, b: str, k) -> tuple[str, str]:
    """(numbers, verdict) of methods a and b at pass@k (k None: entropy): the primary family's verdict where the
    claim is in it, else the exploratory estimate with no verdict."""
    metric = f"pass@{k}" if k is not None else "entropy"
    for v in (rep.get("verdict") or {}).get("tests", []):
        if v.get("metric") == metric and {v.get("first"), v.get("second")} == {a, b}:
            if "p" not in v:
                m = v.get("method")
                nums = (
                    "-"
                    if m is None
                    else (
                        f"{LABELS[v['first']]} - {LABELS[v['second']]} = "
                        f"{_diff_cell({**v, **m})} (method-level estimate; primary)"
                    )
                )
                return nums, verdict_line(v)
            test = v["checkpoint"] if v["level"] == "checkpoint" else v["method"]
            unit = (lambda x: f"{100 * x:+.3g}") if metric != "entropy" else (lambda x: f"{x:+.3g}")
            return (
                f"{LABELS[v['first']]} - {LABELS[v['second']]} = {unit(test['diff'])} "
                f"[{unit(test['low'])}, {unit(test['high'])}], Holm p {v['p_holm']:.2g} (primary)"
            ), verdict_line(v)
    t = find_test(rep, a, b, metric)
    if t is None:
        return "-", "not run"
    return f"{LABELS[a]} - {LABELS[b]} = {_diff_cell(t)}", "exploratory (not in the primary family): no verdict"


def _spread(rep: dict, method: str, key: str) -> str:
    st = rep["across_seeds"].get(method, {}).get(key)
    if not st or st["mean"] is None:
        return "-"
    return f"{st['mean']:.3g} +- {st['std']:.2g} over {len(st['values'])} seed(s)"


def verdict_markdown(rep: dict) -> list[str]:
    """What this run shows of each effect the paper reports, with its numbers and whether the intervals separate."""
    ks, m = rep["k"], rep["methods"]
    small, large = ks[0], ks[-1]
    rows = []
    nums, verdict = _difference(rep, "es", "grpo", large)
    rows.append(("coverage at large k (paper: ES above GRPO at Pass@16/32)", f"Pass@{large}: {nums}", verdict))
    nums, verdict = _difference(rep, "es", "grpo", small)
    rows.append((f"Pass@{small} (paper: GRPO at or above ES)", f"Pass@{small}: {nums}", verdict))
    nums, verdict = _difference(rep, "es", "grpo", None)
    if nums != "-":
        nums += f" (ES {_spread(rep, 'es', 'entropy')}; GRPO {_spread(rep, 'grpo', 'entropy')})"
    rows.append(("entropy (paper: GRPO collapses it, ES keeps it near the base)", nums, verdict))
    ratio = rep["drift_l2_ratio_es_over_grpo"]
    null = ((m.get("es") or {}).get("drift") or {}).get("null")
    rows.append(
        (
            "L2 distance (paper: ES 40.7-44.1x GRPO)",
            f"ES / GRPO = {_f(ratio, '{:.1f}')}x; ES L2 "
            f"{_spread(rep, 'es', 'drift_l2')}, null model {_f((null or {}).get('l2'), '{:.4g}')}",
            _drift_verdict(rep, ratio),
        )
    )
    sparsity = null_verdict(m, rep["thresholds"])
    rows.append(
        (
            "functional sparsity (paper: most ES updates tiny)",
            sparsity[0] if sparsity else "-",
            "set by the step sizes (null model)"
            if sparsity and "alone give" in sparsity[0]
            else "differs from the null model"
            if sparsity
            else "-",
        )
    )
    nums, verdict = _difference(rep, "es_grpo", "grpo_es", large)
    rows.append(("sequential order (paper: ES->GRPO best at hard-math Pass@32)", f"Pass@{large}: {nums}", verdict))
    rows.append(("compute (left open by the paper)", compute_answer(m), "-"))
    lines = ["## Verdict: the paper's effects in this run", "", "| effect | this run | verdict |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    lines += [
        "",
        "A claim is called only where it is in the primary family (verdict.primary, declared before "
        "training) and its one-sided test rejects after Holm's correction over that family; with fewer than 5 "
        "seeds per method the test compares these runs (checkpoint test), not the methods. Everything else is "
        "exploratory. L2: the seeds' runs of ES and GRPO (one value per run, independent: Welch's t).",
        "",
    ]
    return lines


def _drift_verdict(rep: dict, ratio) -> str:
    t = rep.get("drift_test")
    if not ratio:
        return "-"
    moved = "ES moves farther" if ratio > 1 else "ES does not move farther"
    if not t or "diff" not in t:
        return f"{moved} ({(t or {}).get('why', 'no test')})"
    sep = t["p"] < ALPHA_DRIFT and (t["low"] > 0 or t["high"] < 0)
    return (
        f"{moved}: ES - GRPO L2 {t['diff']:+.3g} [{t['low']:+.3g}, {t['high']:+.3g}] over {t['seeds']} seeds "
        f"(Welch's t, {_f(t.get('df'), '{:.1f}')} df), " + ("separable" if sep else "not separable over these seeds")
    )


ALPHA_DRIFT = 0.05


def _budget(b: dict) -> str:
    return {
        "epochs": f"{b['epochs']:g} epochs",
        "tokens": f"{b['tokens']:,} tokens",
        "device_seconds": f"{b['device_seconds']:g} device-s",
    }[b["unit"]]


def compute_answer(methods: dict) -> str:
    """The paper's open question for this run: does ES's lower memory also mean less compute?"""
    es, grpo = (methods.get(m, {}).get("ledger") for m in ("es", "grpo"))
    if not es or not grpo:
        return "Compute: run both es and grpo to compare their cost."
    mem = [(x["peak_gpu_bytes_max"] or x["peak_rss_bytes_max"]) for x in (es, grpo)]
    kind = "GPU" if es["peak_gpu_bytes_max"] and grpo["peak_gpu_bytes_max"] else "resident"
    mem_ratio = mem[1] / mem[0] if mem[0] else None
    dev_ratio = grpo["device_s"] / es["device_s"] if es["device_s"] else None
    tok_ratio = es["tokens_generated"] / grpo["tokens_generated"] if grpo["tokens_generated"] else None
    less_memory = mem_ratio is not None and mem_ratio > 1
    less_compute = dev_ratio is not None and dev_ratio > 1
    return (
        f"Compute (this run): GRPO's largest peak {kind} memory is {_f(mem_ratio, '{:.2f}')}x ES's; GRPO used "
        f"{_f(dev_ratio, '{:.2f}')}x ES's device-seconds while ES generated {_f(tok_ratio, '{:.2f}')}x GRPO's "
        "tokens. "
        + (
            "ES's lower memory came with less compute here."
            if less_memory and less_compute
            else "ES's lower memory did not mean less compute here."
            if less_memory
            else "ES did not use less memory here."
        )
    )


def null_verdict(methods: dict, th) -> list[str]:
    """One line per ES run: does its drift exceed the null model's (10% on L2, 2 points on a sparsity share)?"""
    out = []
    for m in methods.values():
        null = (m.get("drift") or {}).get("null")
        if not null or null["l2"] is None:
            continue
        d = m["drift"]
        l2_ratio = d["l2"] / null["l2"] if null["l2"] else None
        gaps = [
            abs(d["share_below"][f"{t:g}"] - null["share_below"][f"{t:g}"])
            for t in th
            if d["share_below"][f"{t:g}"] is not None and null["share_below"][f"{t:g}"] is not None
        ]
        beyond = (l2_ratio is not None and abs(l2_ratio - 1) > 0.10) or any(g > 0.02 for g in gaps)
        out.append(
            f"{m['label']}: measured L2 / null L2 = {_f(l2_ratio, '{:.3f}')}, largest sparsity-share gap "
            f"{_p(max(gaps) if gaps else None)} points: "
            + (
                "the drift differs from what the step sizes alone give."
                if beyond
                else "the drift and the sparsity are what the step sizes alone give (not evidence of learning)."
            )
        )
    return out
