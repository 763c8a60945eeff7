"""The metric names the methods write into metrics.jsonl and the trackers, and that the progress bar, es-compare's
report and its plots read back: named once here, so a writer and its readers cannot drift apart."""

from __future__ import annotations

REWARD_MEAN = "reward/mean"
"""The mean training reward of a step's samples (ES: the population's perturbed members; GRPO: its groups)."""
REWARD_STD = "reward/std"
HELD_OUT_FIELDS = ("reward", "pass_at_1", "entropy", "tokens", "errors")
"""What a held-out scoring (eval.every) reports, each logged as eval/<field>."""
HELD_OUT_PASS1 = "eval/pass_at_1"
HELD_OUT_REWARD = "eval/reward"
HELD_OUT_ENTROPY = "eval/entropy"
ES_ZERO_UPDATE = "es/zero_update"
"""True where every shaped fitness was zero (no step): the drift null model counts these."""
HELD_OUT_SECONDS = "timing_s/eval"


def held_out_row(res: dict) -> dict:
    """A held-out scoring's answer as metric-row entries (eval/<field>, and its seconds)."""
    return {**{f"eval/{k}": res[k] for k in HELD_OUT_FIELDS}, HELD_OUT_SECONDS: res["seconds"]}
