"""The methods es-compare runs, named once: each one's label, the training parts it runs in order (a sequential
method trains one method's part, then the other's from its final checkpoint), the pairs the verdict reads first,
and where GRPO's parts run. ``run`` builds the stages from these, ``report`` and ``markdown`` print the labels."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Method:
    name: str
    """The key in ``methods=`` and in report.json."""
    label: str
    """What the report prints."""
    parts: tuple[str, ...]
    """The training parts, in order ("es", "grpo"); none: the base model, evaluated as it is."""


ALL = (
    Method("base", "Base", ()),
    Method("es", "ES", ("es",)),
    Method("grpo", "GRPO", ("grpo",)),
    Method("es_grpo", "ES->GRPO", ("es", "grpo")),
    Method("grpo_es", "GRPO->ES", ("grpo", "es")),
)
BY_NAME = {m.name: m for m in ALL}
METHODS = tuple(m.name for m in ALL)
"""Every method, in the order the report lists them."""
LABELS = {m.name: m.label for m in ALL}
TRAINED = {m.name: m.parts for m in ALL if m.parts}
"""The trained methods and their parts."""
PARTS = ("es", "grpo")
"""The training parts a method can be made of (``stages.PART_STAGES`` builds each)."""
COMPARED = (
    ("es", "base"),
    ("grpo", "base"),
    ("es", "grpo"),
    ("es_grpo", "grpo"),
    ("grpo_es", "es"),
    ("es_grpo", "grpo_es"),
)
"""The pairs the verdict reads first, as (first, second) with difference first - second."""


def runs_grpo(methods) -> bool:
    """Whether any of ``methods`` trains a GRPO part."""
    return any("grpo" in BY_NAME[m].parts for m in methods if m in BY_NAME)


def grpo_placement(cfg) -> tuple[bool, int]:
    """(grpo.colocate, rollout actors): GRPO's learner ranks and rollout actors on devices of their own when the
    cluster (cluster.num_actors devices) has room for both, else colocated, one rollout engine per learner rank."""
    g = cfg.grpo
    if g.colocate or g.fsdp_size + cfg.grpo_rollout_actors > cfg.cluster.num_actors:
        return True, g.fsdp_size
    return False, cfg.grpo_rollout_actors


def grpo_placement_text(cfg) -> str:
    colocate, rollouts = grpo_placement(cfg)
    if colocate:
        return (
            f"GRPO ran colocated: {rollouts} actor(s), each holding a learner rank and a rollout engine "
            f"(grpo.colocate; cluster.num_actors={cfg.cluster.num_actors} has no spare devices for "
            f"grpo.fsdp_size={cfg.grpo.fsdp_size} learner ranks beside "
            f"grpo_rollout_actors={cfg.grpo_rollout_actors})"
        )
    return (
        f"GRPO ran on separate devices: {cfg.grpo.fsdp_size} learner rank(s) (grpo.fsdp_size) and {rollouts} "
        "rollout actor(s) (grpo_rollout_actors)"
    )


def budget_units(epochs: float, pool: int, per_unit: int) -> int:
    """Iterations (steps) that show ``epochs * pool`` training prompts, at ``per_unit`` prompts each (at least 1)."""
    return max(1, round(epochs * pool / per_unit))
