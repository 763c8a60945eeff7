"""Teacher-forced scoring of generated completions (torch; no Ray, no vLLM): token entropy and token log-probs.

For each completion token t the model's next-token distribution at the position that produced it, at temperature
T (softmax(l / T), 1 unless given): its entropy H_t = logsumexp(z) - sum softmax(z) * z with z = l / T (natural
log, nats), or the log-probability of the token itself. With top_p < 1 the sampler draws from the nucleus, not
from softmax(z): ``nucleus_entropy_from_logits`` gives the entropy of that renormalised nucleus (what was sampled),
reported beside the untruncated value at T and at T = 1. Entropy is reported as the mean per token over all
completion tokens, the mean of per-completion means, quantiles, and a fixed-bin histogram (so histograms from
many actors add up).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from es_ray.metrics.prefix import prompt_groups, shared_prompt_hidden, valid_rows

HIST_EDGES = np.linspace(0.0, 12.0, 121)
"""Histogram bins in nats (0.1 wide); values above 12 go into the last bin (log(49152) is about 10.8)."""


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """[..., V] logits -> [...] entropy in nats of softmax(logits / temperature), computed in fp32. A -inf logit (a
    masked token) has probability 0 and adds 0 (not 0 * -inf = NaN): the masked distribution's entropy."""
    z = logits.float() / temperature
    logp = torch.log_softmax(z, dim=-1)
    p = logp.exp()
    return -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(dim=-1)


def nucleus_entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0) -> torch.Tensor:
    """[..., V] logits -> [...] entropy in nats of the top-p nucleus of softmax(logits / temperature), renormalised:
    tokens in descending probability order are kept while the mass before them is below top_p (the token that
    crosses top_p is kept, and always the first), as the samplers truncate. top_p = 1: ``entropy_from_logits``."""
    if top_p >= 1.0:
        return entropy_from_logits(logits, temperature)
    p = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_p = p.sort(dim=-1, descending=True).values
    kept = torch.where(sorted_p.cumsum(dim=-1) - sorted_p < top_p, sorted_p, torch.zeros_like(sorted_p))
    q = kept / kept.sum(dim=-1, keepdim=True)
    return -torch.where(q > 0, q * torch.log(q), torch.zeros_like(q)).sum(dim=-1)


def chunked_token_scores(
    head,
    hidden_nh: torch.Tensor,
    tokens_n: torch.Tensor,
    temperature: float = 1.0,
    chunk: int = 1024,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[N, H] hidden states and the [N] tokens they predict -> ([N] log p(token), [N] entropy or None) under
    softmax(head(hidden) / temperature), in fp32 at least, ``chunk`` positions at a time.

    No more than one chunk's [chunk, V] logits exist at once, forward or backward: with gradients enabled each chunk
    runs under torch.utils.checkpoint, so its logits are not kept for the backward pass but recomputed there one
    chunk at a time (the head's forward runs twice; keeping every chunk's graph instead would hold every chunk's
    [chunk, V] log-softmax until the backward, N x V again). Gradients flow to ``hidden_nh`` and the head's weights.
    The entropy is a statistic and comes back detached."""

    def score(h: torch.Tensor, tok: torch.Tensor):
        z = head(h)
        logp = torch.log_softmax((z.float() if z.element_size() < 4 else z) / temperature, dim=-1)
        lp = logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
        if not entropy:
            return lp, None
        with torch.no_grad():  # a -inf logit (masked token) adds 0, not 0 * -inf = NaN, as entropy_from_logits
            p = logp.exp()
            return lp, -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(dim=-1)

    grad = torch.is_grad_enabled()
    parts = []
    for i in range(0, hidden_nh.shape[0], chunk) or [0]:  # N = 0: one empty chunk, so the graph still exists
        h, tok = hidden_nh[i : i + chunk], tokens_n[i : i + chunk]
        parts.append(
            checkpoint(score, h, tok, use_reentrant=False, preserve_rng_state=False) if grad else score(h, tok)
        )
    lp = torch.cat([p[0] for p in parts])
    return lp, (torch.cat([p[1] for p in parts]).detach() if entropy else None)


def _completion_logits(model, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> torch.Tensor:
    """[L, V] logits predicting the L completion tokens, by one forward pass over prompt + completion; only the
    last L + 1 positions go through the LM head (``logits_to_keep``)."""
    L = len(completion_ids)
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids) + list(completion_ids)], device=device)
    # positions len(prompt)-1 .. end-2 predict the completion tokens: the last L+1 logits minus the final one
    return model(input_ids=ids, logits_to_keep=L + 1).logits[0, :-1]


@torch.no_grad()
def completion_entropies(
    model, prompt_ids: Sequence[int], completion_ids: Sequence[int], temperature: float = 1.0, chunk: int = 512
) -> torch.Tensor:
    """[len(completion_ids)] entropies for one completion, by one forward pass over prompt + completion; the
    fp32 softmax runs in chunks of ``chunk`` positions, so its memory is chunk x vocabulary."""
    L = len(completion_ids)
    if L == 0:
        return torch.zeros(0)
    logits = _completion_logits(model, prompt_ids, completion_ids)
    return torch.cat([entropy_from_logits(logits[i : i + chunk], temperature) for i in range(0, L, chunk)]).cpu()


@torch.no_grad()
def completion_log_probs(
    model, prompt_ids: Sequence[int], completion_ids: Sequence[int], temperature: float = 1.0, chunk: int = 512
) -> torch.Tensor:
    """[len(completion_ids)] log p(token | prefix) of softmax(logits / temperature) in fp32, one forward pass (the
    GRPO sync probe: the learner and a transformers engine compute it the same way)."""
    L = len(completion_ids)
    if L == 0:
        return torch.zeros(0)
    logits = _completion_logits(model, prompt_ids, completion_ids)
    target = torch.tensor(list(completion_ids), device=logits.device).unsqueeze(-1)
    return torch.cat(
        [
            torch.log_softmax(logits[i : i + chunk].float() / temperature, dim=-1)
            .gather(-1, target[i : i + chunk])
            .squeeze(-1)
            for i in range(0, L, chunk)
        ]
    ).cpu()


@torch.no_grad()
def batched_completion_entropies(
    model,
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
    temperatures: Sequence[float],
    max_batch_tokens: int = 8192,
    chunk: int = 512,
    top_p: float = 1.0,
) -> list[np.ndarray]:
    """[L_i, len(temperatures)] entropies per completion of ``pairs`` ((prompt ids, completion ids)), teacher-forced
    in batches of at most ``max_batch_tokens`` padded tokens (longest first, right-padded, attention-masked): one
    forward pass per batch instead of one per completion, and every temperature from the same logits. With
    top_p < 1 one more column: the renormalised nucleus's entropy at temperatures[0] (the sampling temperature).

    Completions of one prompt (eval.n samples of a problem) share it: the prompt runs once and its keys and
    values serve them all (``prefix.shared_prompt_hidden``). Only the completion positions go through the LM head,
    ``chunk`` at a time (a [chunk, V] fp32 block)."""
    out: list[np.ndarray | None] = [None] * len(pairs)
    device = next(model.parameters()).device
    head = model.get_output_embeddings()

    def store(batch: list[int], h: torch.Tensor) -> None:
        """[N, H] hidden states predicting the completion tokens of ``batch``'s rows, in order -> each row's
        [L_i, len(temperatures)] entropies in ``out``, the LM head ``chunk`` rows at a time."""

        def columns(z: torch.Tensor) -> list[torch.Tensor]:
            cols = [entropy_from_logits(z, t) for t in temperatures]
            return cols + ([nucleus_entropy_from_logits(z, temperatures[0], top_p)] if top_p < 1.0 else [])

        cols = [
            torch.stack(columns(z), dim=-1)
            for z in (head(h[k : k + chunk]).float() for k in range(0, h.shape[0], chunk))
        ]
        width = len(temperatures) + (1 if top_p < 1.0 else 0)
        scores = (torch.cat(cols) if cols else torch.zeros((0, width))).cpu().numpy()
        for i, piece in zip(batch, np.split(scores, np.cumsum([len(pairs[i][1]) for i in batch])[:-1])):
            out[i] = piece

    single = []
    for group in prompt_groups([tuple(p) for p, _ in pairs]):
        if len(group) == 1 or not pairs[group[0]][0]:
            single += group
            continue
        prompt = pairs[group[0]][0]
        group = sorted(group, key=lambda i: -len(pairs[i][1]))
        start = 0
        while start < len(group):
            rows = max(1, max_batch_tokens // max(1, len(pairs[group[start]][1])))
            batch = group[start : start + rows]
            start += len(batch)
            completions = [pairs[i][1] for i in batch]
            store(
                batch,
                valid_rows(shared_prompt_hidden(model.base_model, prompt, completions), [len(c) for c in completions]),
            )
    order = sorted(single, key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
    start = 0
    while start < len(order):
        width = len(pairs[order[start]][0]) + len(pairs[order[start]][1])
        rows = max(1, max_batch_tokens // max(1, width))
        batch = order[start : start + rows]
        start += len(batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long, device=device)
        attn = torch.zeros_like(ids)
        for b, i in enumerate(batch):
            seq = list(pairs[i][0]) + list(pairs[i][1])
            ids[b, : len(seq)] = torch.tensor(seq, device=device)
            attn[b, : len(seq)] = 1
        hidden = model.base_model(input_ids=ids, attention_mask=attn).last_hidden_state
        # position j predicts token j + 1: each row's completion tokens, all rows through the head together
        store(
            batch,
            torch.cat(
                [hidden[b, len(p) - 1 : len(p) + len(c) - 1] for b, (p, c) in enumerate(pairs[i] for i in batch)]
            ),
        )
    return out


def histogram(values: np.ndarray, edges: np.ndarray = HIST_EDGES) -> np.ndarray:
    """Counts per bin; values beyond the last edge are counted in the last bin."""
    return np.histogram(np.clip(np.asarray(values, dtype=np.float64), edges[0], edges[-1]), bins=edges)[0]


def hist_quantile(counts: np.ndarray, edges: np.ndarray, q: float) -> float:
    """The q-quantile of histogrammed values, interpolated linearly inside its bin."""
    counts = np.asarray(counts, dtype=np.float64)
    cum = np.cumsum(counts)
    target = q * cum[-1]
    i = int(np.searchsorted(cum, target, side="left"))
    i = min(i, len(counts) - 1)
    below = cum[i - 1] if i else 0.0
    frac = (target - below) / counts[i] if counts[i] else 0.0
    return float(edges[i] + frac * (edges[i + 1] - edges[i]))


def summarize_stats(
    sums: Sequence[float], counts: Sequence[int], hist_counts: np.ndarray, edges: np.ndarray = HIST_EDGES
) -> dict:
    """Summary from per-completion (sum of entropies, token count) and the pooled per-token histogram.

    This is what crosses from the actors: two numbers per completion and one histogram, not every token's
    entropy. Quantiles come from the histogram (to within a bin, 0.1 nats).
    """
    sums_c, counts_c = np.asarray(sums, dtype=np.float64), np.asarray(counts, dtype=np.int64)
    keep = counts_c > 0
    if not keep.any():
        return {"mean_per_token": None, "mean_per_completion": None, "tokens": 0, "completions": 0}
    hist_counts = np.asarray(hist_counts, dtype=np.int64)
    return {
        "mean_per_token": float(sums_c[keep].sum() / counts_c[keep].sum()),
        "mean_per_completion": float(np.mean(sums_c[keep] / counts_c[keep])),
        "tokens": int(counts_c[keep].sum()),
        "completions": int(keep.sum()),
        "quantiles": {f"p{int(q * 100)}": hist_quantile(hist_counts, edges, q) for q in (0.1, 0.25, 0.5, 0.75, 0.9)},
        "histogram": {"edges": [float(x) for x in edges], "counts": [int(c) for c in hist_counts]},
    }


def summarize(per_completion: Sequence[np.ndarray], edges: np.ndarray = HIST_EDGES) -> dict:
    """summarize_stats from per-token entropies grouped by completion."""
    arrays = [np.asarray(e, dtype=np.float64) for e in per_completion]
    hist = sum((histogram(a, edges) for a in arrays), np.zeros(len(edges) - 1, dtype=np.int64))
    return summarize_stats([a.sum() for a in arrays], [a.size for a in arrays], hist, edges)
