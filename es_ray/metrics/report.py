"""results.md: the es-eval results as a human-readable table (pure formatting)."""

from __future__ import annotations


def _pct(x) -> str:
    return "-" if x is None or x != x else f"{100 * x:.1f}"


def _num(x, fmt: str = "{:.3f}") -> str:
    return "-" if x is None or x != x else fmt.format(x)


def _sampled(s: dict) -> str:
    """What 'entropy' measures: the sampled distribution, named."""
    t = s.get("entropy_temperatures", [1.0])[0]
    if s.get("top_p", 1.0) < 1 and s["temperature"] > 0:
        return (
            f"the top_p = {s['top_p']} nucleus of softmax(logits / {t}), renormalised (the untruncated "
            f"softmax at T = {t} beside it)"
        )
    return f"softmax(logits / {t})"


def results_markdown(results: dict) -> str:
    s = results["settings"]
    ks = s["k"]
    lines = [
        "# es-eval results",
        "",
        f"- model: `{results['model']}`",
        f"- engine: {s['engine']}, n = {s['n']} samples per problem, temperature {s['temperature']}, "
        f"top_p {s['top_p']}, max_new_tokens {s['max_new_tokens']}, limit {s['limit'] or 'none'}",
        "- pass@k is the unbiased estimator (Chen et al. 2021); maj@k votes over the first k samples "
        "('-': the task has no canonical answer to vote on); values in %",
        f"- entropy: mean per generated token (nats) from a teacher-forced forward pass, of the distribution that "
        f"was sampled: {_sampled(s)}; 'entropy T=1': the model's own distribution",
        "",
    ]
    nucleus = s.get("top_p", 1.0) < 1 and s["temperature"] > 0
    head = (
        ["task", "problems", "n"]
        + [f"pass@{k}" for k in ks]
        + [f"maj@{k}" for k in ks]
        + ["mean reward", "entropy (sampled)"]
        + ([f"entropy T={s['temperature']} untruncated"] if nucleus else [])
        + ["entropy T=1", "tokens/completion", "grader failures", "skipped rows"]
    )
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, t in results["tasks"].items():
        failures = ", ".join(f"{k} {v}" for k, v in sorted(t["grader_failures"].items()) if v) or "0"
        ent = (t.get("entropy") or {}).get("mean_per_token")
        row = (
            [name, str(t["problems"]), str(t["n"])]
            + [_pct(t["pass@k"].get(str(k))) for k in ks]
            + [_pct(t["maj@k"].get(str(k))) if t["maj@k"] else "-" for k in ks]
            + [_num(t["mean_reward"]), _num(ent)]
            + ([_num((t.get("entropy_untruncated") or {}).get("mean_per_token"))] if nucleus else [])
            + [
                _num((t.get("entropy_t1") or {}).get("mean_per_token")),
                _num(t["tokens"]["mean_per_completion"], "{:.1f}"),
                failures,
                str(t["skipped_rows"]),
            ]
        )
        lines.append("| " + " | ".join(row) + " |")
    overall = results.get("entropy", {}).get("mean_per_token")
    lines += [
        "",
        f"Mean token entropy over all tasks: {_num(overall)} nats. "
        f"Wall time {results['timing_s']['total']:.1f} s, {results['tokens_generated']} tokens generated.",
    ]
    checked = {name: t["answer_checks"] for name, t in results["tasks"].items() if t.get("answer_checks")}
    if checked:
        lines += [
            "",
            f"Answer format (eval.answer={s.get('answer', 'boxed')}): correct samples with no final "
            "\\boxed{} answer, correct samples whose answer only restates an expression of the problem, and "
            "pass@k with both counted wrong.",
            "",
            "| task | correct without a box | correct restating | "
            + " | ".join(f"pass@{k} without them" for k in ks)
            + " |",
            "|---|---|---|" + "---|" * len(ks),
        ]
        for name, c in checked.items():
            lines.append(
                f"| {name} | {c['correct_without_box']} | {c['correct_restating']} | "
                + " | ".join(_pct(c["pass@k_without_them"].get(str(k))) for k in ks)
                + " |"
            )
    sandbox = results.get("sandbox")
    if sandbox:
        lines += ["", f"Code sandbox: network {sandbox['network']}; user {sandbox['user']}."]
    return "\n".join(lines) + "\n"
