"""es-compare's report.md: the tables, the uncertainty and differences, and the verdict, from report.json's data
(``launch.compare_report.collect``)."""

from __future__ import annotations

import math

from launch.compare_report import LABELS


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
    lines = ["# es-compare report", "",
             f"Training budget: {_budget(rep['budget'])} per method (unit {rep['budget']['unit']}; pool of "
             f"{rep['pool']} prompts; at most {rep['budget_epochs']:g} epochs; sequential methods: half each). "
             "Evaluation: "
             f"n = {e['n']} samples per problem, temperature {e['temperature']}, top_p {e['top_p']}, "
             f"max_new_tokens {e['max_new_tokens']}, limit {e['limit'] or 'none'}, seed {e['seed']}.", "",
             f"## {kk} (%)", "",
             "| method | " + " | ".join(tasks) + " | average |", "|---|" + "---|" * (len(tasks) + 1)]
    for m in methods.values():
        cells = [" / ".join(_p(m["pass@k"][t][str(k)]) for k in ks) for t in tasks]
        cells.append(" / ".join(_p(m["average"][str(k)]) for k in ks))
        lines.append(f"| {m['label']} | " + " | ".join(cells) + " |")
    lines += uncertainty_markdown(rep)
    lines += entropy_markdown(rep)
    lines += drift_markdown(rep)
    lines += compute_markdown(rep)
    lines += verdict_markdown(rep)
    return "\n".join(lines)


def entropy_markdown(rep: dict) -> list[str]:
    tasks, methods, e = rep["tasks"], rep["methods"], rep["eval"]
    lines = ["", "## Token entropy (nats per generated token, teacher-forced, of the sampled distribution at "
              f"T = {e['temperature']})", "",
              "| method | all tasks | change vs base | " + " | ".join(tasks) + " |",
              "|---|---|---|" + "---|" * len(tasks)]
    before = rep["entropy_before"]
    for m in methods.values():
        now = m["entropy"]["mean_per_token"]
        delta = "-" if before is None or now is None else f"{now - before:+.3f}"
        lines.append(f"| {m['label']} | {_f(now)} | {delta} | "
                     + " | ".join(_f(m["entropy"]["per_task"][t]) for t in tasks) + " |")
    return lines


def drift_markdown(rep: dict) -> list[str]:
    methods, th = rep["methods"], rep["thresholds"]
    lines = ["", "## Drift from the base weights", "",
              "| method | L2 | relative L2 | changed | " + " | ".join(f"\\|d\\| < {t:g}" for t in th)
              + " | max \\|d\\| |",
              "|---|---|---|---|" + "---|" * len(th) + "---|"]
    for m in methods.values():
        d = m.get("drift")
        if d is None:
            continue
        lines.append(f"| {m['label']} | {d['l2']:.4g} | {_f(d['relative_l2'], '{:.3e}')} | "
                     f"{_p(d['share_nonzero'])}% | "
                     + " | ".join(f"{_p(d['share_below'][f'{t:g}'])}%" for t in th) + f" | {d['max_abs']:.3g} |")
        c = d.get("cast")
        if c is not None:
            lines.append(f"| {m['label']} (weights in {c['dtype']}) | {c['l2']:.4g} | {_f(c['relative_l2'], '{:.3e}')} "
                         f"| {_p(c['share_nonzero'])}% | "
                         + " | ".join(f"{_p(c['share_below'][f'{t:g}'])}%" for t in th) + f" | {c['max_abs']:.3g} |")
        null = d.get("null")
        if null is not None:
            if null["l2"] is None:
                lines.append(f"| {m['label']}: null model | - | - | - | " + " | ".join("-" for _ in th)
                             + f" | not applicable: {null['why']} |")
            else:
                lines.append(f"| {m['label']}: null model (rewards ignored) | {null['l2']:.4g} | - | - | "
                             + " | ".join(f"{_p(null['share_below'][f'{t:g}'])}%" for t in th) + " | - |")
    ratio = rep["drift_l2_ratio_es_over_grpo"]
    lines += ["", f"L2 ratio ES / GRPO: {_f(ratio, '{:.2f}')}. The thresholds columns are the share of changed "
              "parameters whose change is below each threshold (functional sparsity). Rows '(weights in bfloat16)' "
              "measure the same two checkpoints cast to the dtype a GPU engine holds: an update below half a ulp of "
              "its weight (|w| / 256 in bf16) vanishes there, so sparsity on fp32 weights can overstate what the "
              "engine sees.", "",
              "Null model: with z-scored (or ranked) fitness an SGD step of ES moves every weight by Normal(0, "
              "(lr / (N sigma))^2 sum z^2) whatever the rewards, so T steps are a random walk "
              "(es_ray/eval/null_drift.py). "
              "A measured L2 or sparsity share close to the null's is set by the step sizes, not by what ES learned.",
              ""] + null_verdict(methods, th)
    return lines


def compute_markdown(rep: dict) -> list[str]:
    ks, methods = rep["k"], rep["methods"]
    lines = ["", "## Compute ledger (measured)", "",
              f"Budget matched in {rep['budget']['unit']} ({_budget(rep['budget'])} per method).", "",
              "| method | tokens generated | tokens back-propagated | wall s | device-s | peak RSS per process GiB "
              "| peak GPU GiB | held-out pass@1 gained per 1000 device-s |", "|---|---|---|---|---|---|---|---|"]
    base_p1 = methods.get("base", {}).get("average", {}).get(str(ks[0]))
    for m in methods.values():
        led = m["ledger"]
        if led is None:
            continue
        gain = (None if base_p1 is None or not led["device_s"] else
                1000 * (m["average"][str(ks[0])] - base_p1) / led["device_s"])
        lines.append(f"| {m['label']} | {led['tokens_generated']:,} | {led['tokens_backpropagated']:,} | "
                     f"{led['wall_s']:.0f} | {led['device_s']:.0f} {led['device']} | "
                     f"{_gib(led['peak_rss_bytes_max'])} | {_gib(led['peak_gpu_bytes_max'])} | "
                     f"{_f(None if gain is None else 100 * gain, '{:+.2f}')} points |")
    lines += ["", compute_answer(methods)]
    lines += ["", "device-s: for every actor, the devices it held (GPUs, or CPU cores on a CPU-only actor) times the "
              "seconds it was held, summed (es_ray.runtime.ledger, the same code for every method). Peak memory: the "
              "largest peak resident set of any actor process of the run (and its peak GPU allocation).", "",
              "Plots: " + ", ".join(f"`{p}`" for p in rep.get("plots", [])), ""]
    return lines


def _iv(x) -> str:
    return f"[{_p(x[0])}, {_p(x[1])}]"


def uncertainty_markdown(rep: dict) -> list[str]:
    """Mean +- std over seeds with the bootstrap interval, and the differences the intervals support."""
    ks, seeds, iv = rep["k"], rep["seeds"], rep["intervals"]
    lines = ["", f"## Uncertainty: average {'/'.join(f'Pass@{k}' for k in ks)} over tasks (%)", "",
             f"Mean +- std over seeds {seeds} (the first seed's run is the one the other tables show), and the 95% "
             "bootstrap interval over problems with the seeds pooled.", "",
             "| method | " + " | ".join(f"Pass@{k}" for k in ks) + " |", "|---|" + "---|" * len(ks)]
    for method, m in rep["methods"].items():
        acr = rep["across_seeds"][method]["average"]
        cells = [f"{_p(acr[str(k)]['mean'])} +- {_p(acr[str(k)]['std'])} "
                 + (_iv(iv[method]["average"][str(k)]) if method in iv else "") for k in ks]
        lines.append(f"| {m['label']} | " + " | ".join(cells) + " |")
    if rep["differences"]:
        lines += ["", "Differences (called only when the two 95% intervals do not overlap):", "",
                  "| compared | k | first | second | verdict |", "|---|---|---|---|---|"]
        for d in rep["differences"]:
            a, b = LABELS[d["a"]], LABELS[d["b"]]
            verdict = {1: f"{a} higher", -1: f"{b} higher", 0: "not separable (intervals overlap)"}[d["separated"]]
            lines.append(f"| {a} vs {b} | {d['k']} | {_iv(d['a_interval'])} | {_iv(d['b_interval'])} | {verdict} |")
    return lines


def _difference(rep: dict, a: str, b: str, k: int) -> tuple[str, str]:
    """(numbers, verdict) of the interval comparison of methods a and b at pass@k."""
    d = next((x for x in rep["differences"] if x["a"] == a and x["b"] == b and x["k"] == k), None)
    if d is None:
        return "-", "not run"
    la, lb = LABELS[a], LABELS[b]
    nums = f"{la} {_iv(d['a_interval'])} vs {lb} {_iv(d['b_interval'])}"
    return nums, {1: f"{la} higher (intervals separate)", -1: f"{lb} higher (intervals separate)",
                  0: "no separable difference"}[d["separated"]]


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
    ent = {k: (m.get(k) or {}).get("entropy", {}).get("mean_per_token") for k in ("base", "es", "grpo")}
    if all(v is not None for v in ent.values()):
        e_es, e_grpo = ent["es"] - ent["base"], ent["grpo"] - ent["base"]
        sds = [rep["across_seeds"][k]["entropy"]["std"] for k in ("es", "grpo")]
        clear = len(rep["seeds"]) > 1 and abs(e_es - e_grpo) > 2 * max(sds)
        rows.append(("entropy (paper: GRPO collapses it, ES keeps it near the base)",
                     f"change vs base: ES {e_es:+.3f}, GRPO {e_grpo:+.3f} nats (ES {_spread(rep, 'es', 'entropy')}; "
                     f"GRPO {_spread(rep, 'grpo', 'entropy')})",
                     ("ES keeps more entropy than GRPO" if e_es > e_grpo else "GRPO keeps more entropy than ES")
                     + (" (gap above 2 std over seeds)" if clear else
                        " (not separable: one seed, or within 2 std over seeds)")))
    ratio = rep["drift_l2_ratio_es_over_grpo"]
    null = ((m.get("es") or {}).get("drift") or {}).get("null")
    rows.append(("L2 distance (paper: ES 40.7-44.1x GRPO)", f"ES / GRPO = {_f(ratio, '{:.1f}')}x; ES L2 "
                 f"{_spread(rep, 'es', 'drift_l2')}, null model {_f((null or {}).get('l2'), '{:.4g}')}",
                 "ES moves farther" if ratio and ratio > 1 else "ES does not move farther" if ratio else "-"))
    sparsity = null_verdict(m, rep["thresholds"])
    rows.append(("functional sparsity (paper: most ES updates tiny)", sparsity[0] if sparsity else "-",
                 "set by the step sizes (null model)" if sparsity and "alone give" in sparsity[0] else
                 "differs from the null model" if sparsity else "-"))
    nums, verdict = _difference(rep, "es_grpo", "grpo_es", large)
    rows.append(("sequential order (paper: ES->GRPO best at hard-math Pass@32)", f"Pass@{large}: {nums}", verdict))
    rows.append(("compute (left open by the paper)", compute_answer(m), "-"))
    lines = ["## Verdict: the paper's effects in this run", "",
             "| effect | this run | verdict |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    lines += ["", "A difference is called only where the 95% bootstrap intervals over problems separate (or, for "
              "entropy, the gap exceeds twice the spread over seeds); with one seed and few problems most gaps are "
              "within the noise, and the verdict says so.", ""]
    return lines


def _budget(b: dict) -> str:
    return {"epochs": f"{b['epochs']:g} epochs", "tokens": f"{b['tokens']:,} tokens",
            "device_seconds": f"{b['device_seconds']:g} device-s"}[b["unit"]]


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
    return (f"Compute (this run): GRPO's largest peak {kind} memory is {_f(mem_ratio, '{:.2f}')}x ES's; GRPO used "
            f"{_f(dev_ratio, '{:.2f}')}x ES's device-seconds while ES generated {_f(tok_ratio, '{:.2f}')}x GRPO's "
            "tokens. " + ("ES's lower memory came with less compute here." if less_memory and less_compute else
                          "ES's lower memory did not mean less compute here." if less_memory else
                          "ES did not use less memory here."))


def null_verdict(methods: dict, th) -> list[str]:
    """One line per ES run: does its drift exceed the null model's (10% on L2, 2 points on a sparsity share)?"""
    out = []
    for m in methods.values():
        null = (m.get("drift") or {}).get("null")
        if not null or null["l2"] is None:
            continue
        d = m["drift"]
        l2_ratio = d["l2"] / null["l2"] if null["l2"] else None
        gaps = [abs(d["share_below"][f"{t:g}"] - null["share_below"][f"{t:g}"]) for t in th
                if d["share_below"][f"{t:g}"] is not None and null["share_below"][f"{t:g}"] is not None]
        beyond = (l2_ratio is not None and abs(l2_ratio - 1) > 0.10) or any(g > 0.02 for g in gaps)
        out.append(f"{m['label']}: measured L2 / null L2 = {_f(l2_ratio, '{:.3f}')}, largest sparsity-share gap "
                   f"{_p(max(gaps) if gaps else None)} points: "
                   + ("the drift differs from what the step sizes alone give." if beyond else
                      "the drift and the sparsity are what the step sizes alone give (not evidence of learning)."))
    return out
