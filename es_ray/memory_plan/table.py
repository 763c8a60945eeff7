"""``python -m es_ray.memory_plan``: the table of docs/memory-plan.md (per model and setup, per card: GiB on the
fullest GPU, whether it fits, and vLLM's share or the tensor-parallel degree that would fit), and with --detail every
line of each plan."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from es_ray.core.memory import CUDA_CONTEXT_BYTES, GiB
from es_ray.engine_memory import vllm_batch_defaults
from es_ray.grpo.learner_memory import LEARNER_VARIANTS
from es_ray.memory_plan.plan import (
    CARD_GIB,
    CARD_NAMES,
    FSDP_DEGREES,
    PLAN_MARGIN,
    PLANNERS,
    MemoryPlan,
    Settings,
    card_bytes,
    engine_share,
    usable_bytes,
)
from es_ray.model_shape import PRESETS, ModelShape, preset

SETUPS = (
    ("ES, sgd", "es", {"optimizer": "sgd"}),
    ("ES, adam", "es", {"optimizer": "adam"}),
    *((f"GRPO, {v.label}", "grpo", {"learner": name}) for name, v in LEARNER_VARIANTS.items()),
    *(
        (f"GRPO, bf16_mixed, grpo.fsdp_size={f}", "grpo", {"learner": "bf16_mixed", "fsdp_size": f})
        for f in FSDP_DEGREES
    ),
    (
        "GRPO, bf16_mixed, fsdp 8, grpo.colocate=true",
        "grpo",
        {"learner": "bf16_mixed", "fsdp_size": 8, "colocate": True},
    ),
)


def cell(plan: MemoryPlan, card_bytes: int) -> str:
    """GiB on the fullest GPU, and whether it fits a card that reports ``card_bytes`` (usable_bytes of it)."""
    total, usable = f"{plan.total / GiB:.1f}", usable_bytes(card_bytes)
    if plan.fits(usable):
        share = (
            f", vLLM {plan.gpu_memory_utilization(card_bytes):.2f}"
            if plan.method == "es"
            else f", vLLM {engine_share(plan):.2f}"
            if plan.settings.colocate
            else ""
        )
        return f"{total} fits{share}"
    if plan.method == "grpo" and (plan.gpus.get("learner", 0) > usable or plan.settings.colocate):
        return f"{total} no"
    tp = plan.tp_needed(usable)
    return f"{total} no, TP {tp} fits" if tp else f"{total} no (no TP fits)"


def table(models: list[ModelShape], cards_gb=(24, 40, 80, 141), base: Settings = Settings()) -> str:
    """Markdown: per model and setup, per card (as it reports itself: CARD_GIB): GiB on the fullest GPU, whether it
    fits (with vLLM's share for ES) and, when it does not, the tensor-parallel degree that would fit."""
    head = [
        "| model | params | setup | " + " | ".join(f"{c} GB" for c in cards_gb) + " |",
        "|---|---:|---|" + "---|" * len(cards_gb),
    ]
    rows = []
    for m in models:
        for label, method, changes in SETUPS:
            cells = []
            for c in cards_gb:
                card = card_bytes(c)
                plan = PLANNERS[method](
                    m, replace(base, **changes, card_bytes=card, **vllm_batch_defaults(card, CARD_NAMES.get(c, "")))
                )
                cells.append(cell(plan, card))
            rows.append(f"| {m.name} | {m.parameters() / 1e9:.2f}B | {label} | " + " | ".join(cells) + " |")
    return "\n".join(head + rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m es_ray.memory_plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", choices=list(PRESETS), help="a preset (default: all four)")
    ap.add_argument("--config", action="append", default=[], help="an HF config.json (or a model directory)")
    ap.add_argument(
        "--cards",
        type=int,
        nargs="+",
        default=list(CARD_GIB),
        help="card sizes in GB, planned as what such a card reports (CARD_GIB; others as that many GiB)",
    )
    ap.add_argument("--sequences", type=int, default=Settings.sequences)
    ap.add_argument("--tokens", type=int, default=Settings.tokens_per_sequence, help="prompt + completion per sequence")
    ap.add_argument("--completion-tokens", type=int, default=Settings.completion_tokens)
    ap.add_argument("--micro-batch", type=int, default=Settings.micro_batch_size)
    ap.add_argument("--detail", action="store_true", help="also every line of each plan (first card's defaults)")
    args = ap.parse_args(argv)
    models = [preset(n) for n in (args.model or ([] if args.config else list(PRESETS)))]
    for path in args.config:
        p = Path(path)
        try:
            models.append(
                ModelShape.from_dir(p)
                if p.is_dir()
                else ModelShape.from_hf_config(json.loads(p.read_text()), name=p.parent.name or p.stem)
            )
        except KeyError as e:
            ap.error(f"--config {path}: no {e} in the model's config")
        except (OSError, ValueError) as e:  # unreadable, not JSON, or a model the plan does not count
            ap.error(f"--config {path}: {e}")
    base = Settings(
        sequences=args.sequences,
        tokens_per_sequence=args.tokens,
        completion_tokens=args.completion_tokens,
        micro_batch_size=args.micro_batch,
    )
    print(table(models, tuple(args.cards), base))
    cards = ", ".join(f"{c} GB = {card_bytes(c) / GiB:.1f} GiB" for c in args.cards)
    print(
        "\nGiB on the fullest GPU (ES: vLLM + replica on one GPU; GRPO: a learner rank's GPU, a rollout GPU, or "
        "with grpo.colocate both on one); vLLM x.xx is engine.gpu_memory_utilization. Cards as they report "
        f"themselves ({cards}), of which a plan may use all but {PLAN_MARGIN:.0%} and "
        f"{CUDA_CONTEXT_BYTES / GiB:.1f} GiB of CUDA context. KV cache for {args.sequences} sequences x "
        f"{args.tokens} tokens, bf16 engine; GRPO micro-batch {args.micro_batch} x {args.tokens} tokens "
        f"({args.completion_tokens} completion; each FSDP rank its share), gradient checkpointing on."
    )
    if args.detail:
        for m in models:
            for label, method, changes in SETUPS:
                card = card_bytes(args.cards[0])
                plan = PLANNERS[method](
                    m,
                    replace(
                        base, **changes, card_bytes=card, **vllm_batch_defaults(card, CARD_NAMES.get(args.cards[0], ""))
                    ),
                )
                print(f"\n{label}: " + plan.markdown())
    return 0
