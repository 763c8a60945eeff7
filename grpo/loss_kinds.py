"""grpo.loss_type and grpo.adv_scale: the functions and their tables, written on tensor methods only, so this module
imports no torch: the driver checks a config by these names without it (grpo/loss.py, which re-exports both
tables, calls them). Shapes as grpo/loss.py's: P prompts x G completions, B sequences."""

from __future__ import annotations

from es_ray.core.registry import Registry


def group_std(r_pg, centred_pg, eps):
    """A = centred / (the group's population std + eps)."""
    return centred_pg / (r_pg.std(dim=1, unbiased=False, keepdim=True) + eps)


def batch_std(r_pg, centred_pg, eps):
    """A = centred / (the population std of all P * G rewards + eps)."""
    return centred_pg / (r_pg.std(unbiased=False) + eps)


def unscaled(r_pg, centred_pg, eps):
    """A = centred (no eps)."""
    return centred_pg


ADV_SCALES = Registry("grpo.adv_scale", {"group": group_std, "batch": batch_std, "none": unscaled})
"""What the centred rewards are divided by: fn(r_pg, centred_pg, eps)."""


def per_sequence_mean(summed_b, mask_bt, n, max_tokens, num_tokens):
    """grpo: (1/N) sum_i (1/L_i) sum_t l_it."""
    return (summed_b / mask_bt.sum(dim=1).clamp(min=1.0)).sum() / n


def constant_normaliser(summed_b, mask_bt, n, max_tokens, num_tokens):
    """dr_grpo: (1/(N * max_tokens)) sum_i sum_t l_it."""
    return summed_b.sum() / (n * max_tokens)


def token_mean(summed_b, mask_bt, n, max_tokens, num_tokens):
    """dapo: (1/M) sum_i sum_t l_it, M the batch's tokens (``num_tokens``, else this mask's)."""
    m = mask_bt.sum() if num_tokens is None else summed_b.new_tensor(float(num_tokens))
    return summed_b.sum() / m.clamp(min=1.0)


LOSS_AGGREGATIONS = Registry(
    "grpo.loss_type", {"grpo": per_sequence_mean, "dr_grpo": constant_normaliser, "dapo": token_mean}
)
"""How the per-token loss becomes a scalar (grpo, dr_grpo, dapo); each entry is fn(summed_b, mask_bt, N,
max_tokens, M) with summed_b the per-sequence token sums (grpo/loss.py ``aggregate``)."""
