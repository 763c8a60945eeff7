"""GRPO math, pure torch (no Ray, no vLLM): group-relative advantages, the clipped surrogate with an optional k3 KL,
and the three loss aggregations. Token log-probs (at the sampling temperature, chunked over positions) are
es_ray.metrics.entropy.chunked_token_scores.

Shapes: P prompts x G completions per prompt; B = P * G sequences; T = the longest completion in a micro-batch.
``mask_bt`` is 1 on completion tokens and 0 on padding.
"""

from __future__ import annotations

import torch

from es_ray.grpo.loss_kinds import ADV_SCALES, LOSS_AGGREGATIONS
from es_ray.metrics.coverage import pass_at_k_advantages as contributions


def group_advantages(rewards_pg: torch.Tensor, scale: str = "group", eps: float = 1e-6) -> torch.Tensor:
    """[P, G] rewards -> [P, G] advantages A = (r - mean_group(r)) / (s + eps).

    s is the group's std (``group``), the std of all P * G rewards (``batch``), or 1 with no eps (``none``).
    Std is the population std (divide by G, not G - 1). A group whose rewards are all equal gets A = 0 exactly
    (the numerator is 0), never NaN.
    """
    r = rewards_pg.to(torch.float64)
    return ADV_SCALES.get(scale)(r, r - r.mean(dim=1, keepdim=True), eps)


def pass_at_k_advantages(rewards_pg: torch.Tensor, k: int, scale: str = "group", eps: float = 1e-6) -> torch.Tensor:
    """[P, G] rewards -> [P, G] pass@k advantages: each completion's contribution to its group's pass@k
    (es_ray.metrics.coverage.pass_at_k_advantages; docs/grpo.md "The pass@k objective"), divided as
    ``group_advantages`` divides (grpo.adv_scale). With k = G this is verl's GRPO_PASSK: r_max - r_second for the
    best completion of a group, 0 for the rest."""
    r = rewards_pg.to(torch.float64)
    return ADV_SCALES.get(scale)(r, torch.from_numpy(contributions(r.numpy(), k)), eps)


def objective_advantages(
    rewards_pg: torch.Tensor, objective: str, k: int, scale: str = "group", eps: float = 1e-6
) -> torch.Tensor:
    """The advantages of task.objective: group-relative for mean, pass@k contributions for pass_at_k."""
    if objective == "pass_at_k":
        return pass_at_k_advantages(rewards_pg, k, scale, eps)
    return group_advantages(rewards_pg, scale, eps)


def k3_kl(logp_bt: torch.Tensor, ref_logp_bt: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || pi_ref): exp(ref - logp) - (ref - logp) - 1 (>= 0, unbiased)."""
    d = ref_logp_bt - logp_bt
    return torch.exp(d) - d - 1.0


def aggregate(
    per_token_bt: torch.Tensor,
    mask_bt: torch.Tensor,
    loss_type: str,
    max_tokens: int,
    num_sequences: float | None = None,
    num_tokens: float | None = None,
) -> torch.Tensor:
    """Reduce a [B, T] per-token loss to a scalar; L_i is sequence i's token count, N the sequences, M the tokens.

    grpo:    (1/N) sum_i (1/L_i) sum_t l_it                 mean over sequences of per-sequence token means
    dr_grpo: (1/(N * max_tokens)) sum_i sum_t l_it           a constant normaliser (Dr. GRPO): no length bias
    dapo:    (1/M) sum_i sum_t l_it                          token mean over the batch (DAPO)

    ``num_sequences`` / ``num_tokens`` are N and M of the whole batch when this is one micro-batch of it, so that
    micro-batch losses add up to the batch loss exactly; by default they are this tensor's own.
    """
    mask = mask_bt.to(per_token_bt.dtype)
    n = float(mask.shape[0]) if num_sequences is None else float(num_sequences)
    summed_b = (per_token_bt * mask).sum(dim=1)
    return LOSS_AGGREGATIONS.get(loss_type)(summed_b, mask, n, max_tokens, num_tokens)


def grpo_loss(
    logp_bt: torch.Tensor,
    old_logp_bt: torch.Tensor,
    adv_b: torch.Tensor,
    mask_bt: torch.Tensor,
    *,
    loss_type: str = "grpo",
    clip_eps: float = 0.2,
    clip_eps_high: float = 0.0,
    beta: float = 0.0,
    ref_logp_bt: torch.Tensor | None = None,
    max_tokens: int = 1,
    num_sequences: float | None = None,
    num_tokens: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO objective for one (micro-)batch, to minimise.

    Per token, with rho = exp(logp - old_logp) and A the sequence's advantage:
        l_t = -min(rho * A, clip(rho, 1 - clip_eps, 1 + eps_high) * A) + beta * k3(logp, ref_logp)
    with eps_high = clip_eps_high or clip_eps, aggregated by ``aggregate``. Returns (loss, stats), the stats as
    token sums over the mask (detached) so that micro-batches add up: clipped tokens (the clip is active: rho
    below 1 - clip_eps with A < 0, or above 1 + eps_high with A > 0), kl, ratio, and the token count.
    """
    high = clip_eps_high or clip_eps
    adv_bt = adv_b.to(logp_bt.dtype).unsqueeze(1)
    ratio = torch.exp(logp_bt - old_logp_bt)
    unclipped = ratio * adv_bt
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + high) * adv_bt
    per_token = -torch.minimum(unclipped, clipped)
    mask = mask_bt.to(logp_bt.dtype)
    kl = torch.zeros_like(logp_bt)
    if beta > 0:
        if ref_logp_bt is None:
            raise ValueError("beta > 0 needs the reference log-probs (ref_logp_bt)")
        kl = k3_kl(logp_bt, ref_logp_bt)
        per_token = per_token + beta * kl
    loss = aggregate(per_token, mask, loss_type, max_tokens, num_sequences, num_tokens)
    with torch.no_grad():
        is_clipped = ((ratio < 1.0 - clip_eps) & (adv_bt < 0)) | ((ratio > 1.0 + high) & (adv_bt > 0))
        stats = {
            "clipped_tokens": (is_clipped.to(mask.dtype) * mask).sum(),
            "kl_sum": (kl * mask).sum(),
            "ratio_sum": (ratio * mask).sum(),
            "tokens": mask.sum(),
        }
    return loss, stats
