"""How many evaluation completions stopped at eval.max_new_tokens, per method, and the report's warning when most
did: such completions are cut before their answer, so a pass@k near 0 says more about the token limit than about
the method."""

from __future__ import annotations

WARN_SHARE = 0.5
"""The report warns when more than this share of a method's completions hit the limit."""


def truncated_share(samples: list[dict], max_new_tokens: int) -> float | None:
    """The share of ``samples`` (samples.jsonl rows, each with its generated ``tokens``) that used every one of
    ``max_new_tokens``; None without samples."""
    if not samples or max_new_tokens <= 0:
        return None
    return sum(int(s.get("tokens") or 0) >= max_new_tokens for s in samples) / len(samples)


def truncation_markdown(rep: dict) -> list[str]:
    """A warning paragraph when most completions of some method hit max_new_tokens; nothing otherwise."""
    cut = {m["label"]: m.get("hit_max_new_tokens") for m in rep["methods"].values()}
    over = {label: share for label, share in cut.items() if share is not None and share > WARN_SHARE}
    if not over:
        return []
    limit = rep["eval"]["max_new_tokens"]
    shares = ", ".join(f"{label} {share:.0%}" for label, share in over.items())
    return [
        "",
        f"**Warning: most completions hit max_new_tokens.** Share of evaluation completions that used all "
        f"{limit} tokens: {shares}. They were cut before they could finish, so their answers (and pass@k) "
        f"mostly measure the limit, not the method: raise eval.max_new_tokens= (or shorten the prompt's "
        f"expected answer) before reading the tables below.",
    ]
