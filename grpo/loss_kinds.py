"""grpo.loss_type and grpo.adv_scale's values, without torch: the driver checks a config by these names, and the
functions themselves (grpo/loss.py, which re-exports both registries) are imported when first used."""

from __future__ import annotations

from es_ray.core.registry import Registry

LOSS_AGGREGATIONS = Registry("grpo.loss_type", {
    "grpo": "es_ray.grpo.loss:_per_sequence_mean",
    "dr_grpo": "es_ray.grpo.loss:_constant_normaliser",
    "dapo": "es_ray.grpo.loss:_token_mean",
})
"""How the per-token loss becomes a scalar (grpo, dr_grpo, dapo); each entry is fn(summed_b, mask, N, max_tokens,
M) with summed_b the per-sequence token sums."""
ADV_SCALES = Registry("grpo.adv_scale", {
    "group": "es_ray.grpo.loss:_group_std",
    "batch": "es_ray.grpo.loss:_batch_std",
    "none": "es_ray.grpo.loss:_unscaled",
})
"""What the centred rewards are divided by: fn(r_pg, centred_pg, eps)."""
