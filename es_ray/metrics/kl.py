"""Off-task KL between two models' sampled distributions, teacher-forced on the same tokens (torch; no Ray, no vLLM).

At each position of a completion the reference model (the base) and the tuned model each give a next-token
distribution over one vocabulary; the distribution that is sampled is softmax(logits / T), and with top_p < 1 its
top-p nucleus renormalised (``es_ray.metrics.entropy.nucleus_entropy_from_logits`` truncates the same way). Per token,
in nats, both directions:

    KL(base || tuned) = sum_v p_v (log p_v - log q_v)        KL(tuned || base) = sum_v q_v (log q_v - log p_v)

The untruncated values at T are always finite. The nucleus values are infinite where one nucleus holds a token the
other's lacks; ``summarize_kl`` reports their mean over the finite positions and the share that are infinite.
Completions are the base model's own samples (docs/evaluation.md, "Off-task KL"), so KL(base || tuned) is the
expectation that those samples estimate without bias.
"""

from __future__ import annotations

from typing import Sequence

import torch


def log_probs(logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0) -> torch.Tensor:
    """[..., V] logits -> [..., V] log-probabilities of the sampled distribution (-inf outside the nucleus), in fp64:
    a small KL is a difference of nearly equal terms, and fp32 loses its fourth digit."""
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    if top_p >= 1.0:
        return logp
    p = logp.exp()
    sorted_p, order = p.sort(dim=-1, descending=True)
    keep_sorted = sorted_p.cumsum(dim=-1) - sorted_p < top_p  # the token that crosses top_p is kept, and the first
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    kept = torch.where(keep, logp, torch.full_like(logp, float("-inf")))
    return kept - torch.logsumexp(kept, dim=-1, keepdim=True)


def kl_from_log_probs(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """[..., V] log p, log q -> [...] KL(p || q) = sum_v p_v (log p_v - log q_v); inf where p > 0 = q."""
    p = logp.exp()
    diff = torch.where(p > 0, logp - logq, torch.zeros_like(logp))
    return (p * diff).sum(dim=-1)


def token_kl(
    base_logits: torch.Tensor, tuned_logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0
) -> dict[str, torch.Tensor]:
    """[N, V] logits of the two models at the same N positions -> per position KL both ways at T untruncated
    (``base_tuned``, ``tuned_base``) and, with top_p < 1, of the two nuclei (``nucleus_base_tuned``, ...)."""
    if base_logits.shape != tuned_logits.shape:
        raise ValueError(
            f"the two models' logits differ in shape: {tuple(base_logits.shape)} vs "
            f"{tuple(tuned_logits.shape)} (different vocabularies?)"
        )
    lp, lq = log_probs(base_logits, temperature), log_probs(tuned_logits, temperature)
    out = {"base_tuned": kl_from_log_probs(lp, lq), "tuned_base": kl_from_log_probs(lq, lp)}
    if top_p < 1.0:
        np_, nq = log_probs(base_logits, temperature, top_p), log_probs(tuned_logits, temperature, top_p)
        out["nucleus_base_tuned"] = kl_from_log_probs(np_, nq)
        out["nucleus_tuned_base"] = kl_from_log_probs(nq, np_)
    return out


def completion_kl_sums(
    base_logits: torch.Tensor, tuned_logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0, chunk: int = 64
) -> dict[str, float]:
    """One completion's [L, V] logits from each model -> the sums over its L tokens of each direction's KL (nucleus:
    over the finite positions, with ``<key>_infinite`` counting the others), and ``tokens`` = L. Chunks of
    ``chunk`` positions keep the fp64 work at chunk x V."""
    sums: dict[str, float] = {"tokens": int(base_logits.shape[0])}
    for i in range(0, base_logits.shape[0], chunk):
        for key, v in token_kl(base_logits[i : i + chunk], tuned_logits[i : i + chunk], temperature, top_p).items():
            finite = torch.isfinite(v)
            sums[key] = sums.get(key, 0.0) + float(v[finite].double().sum())
            if key.startswith("nucleus_"):
                sums[f"{key}_infinite"] = sums.get(f"{key}_infinite", 0) + int((~finite).sum())
    return sums


def summarize_kl(per_sample: Sequence[dict], problems: Sequence[int]) -> dict:
    """Per-sample sums (``completion_kl_sums``) and each sample's problem -> the mean per token of each direction,
    the token count, the share of infinite nucleus positions, and the per-problem means per token (the unit a paired
    comparison resamples)."""
    tokens = sum(s["tokens"] for s in per_sample)
    keys = sorted({k for s in per_sample for k in s if k != "tokens" and not k.endswith("_infinite")})
    out: dict = {"tokens": tokens, "samples": len(per_sample)}
    for key in keys:
        inf = sum(s.get(f"{key}_infinite", 0) for s in per_sample)
        finite = tokens - inf
        out[key] = sum(s.get(key, 0.0) for s in per_sample) / finite if finite else None
        if key.startswith("nucleus_"):
            out[f"{key}_infinite_share"] = inf / tokens if tokens else None
    by_problem: dict[int, list[dict]] = {}
    for p, s in zip(problems, per_sample):
        by_problem.setdefault(int(p), []).append(s)
    out["per_problem"] = {
        str(p): {
            key: (sum(s.get(key, 0.0) for s in ss) / max(1, sum(s["tokens"] - s.get(f"{key}_infinite", 0) for s in ss)))
            for key in keys
            if not key.startswith("nucleus_")
        }
        for p, ss in sorted(by_problem.items())
    }
    return out
