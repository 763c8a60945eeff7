"""Where the actors run: one Ray placement group per run, one bundle per actor (rank i -> bundle i).

`cluster.placement=pack` (default) fills a node before the next, which keeps an 8-GPU node's actors together;
`spread` puts actors on different nodes where it can. Before any actor starts, `check_fit` compares what the
actors need (num_actors x gpus_per_actor GPUs, num_actors x cpus_per_actor CPUs, each bundle on one node) with
the cluster's nodes and fails with both numbers, instead of Ray's silent wait for resources that never come.

`actor_options(placement, rank)` gives the Ray options for rank i's actor, so a replacement for a dead actor
lands in the same bundle (Ray reschedules a bundle whose node died). A driver with more actors of the same shape
than cluster.num_actors (GRPO: the rollout actors and a learner) passes `count=`. Ray is imported inside the
functions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from es_ray.core.config import ClusterConfig, ConfigError

# With cluster.wait_for_resources_s=0 the resources exist in total but may be held by other jobs for a while.
BUSY_WAIT_S = 300.0


@dataclass(frozen=True)
class Needs:
    """What the run's actors ask the cluster for, in Ray resource names."""

    bundle: dict[str, float]
    num_actors: int
    who: str = ""
    """How the count reads in messages (default: cluster.num_actors=<n>)."""

    @property
    def total(self) -> dict[str, float]:
        return {k: v * self.num_actors for k, v in self.bundle.items()}


def needs(cluster: ClusterConfig, count: int | None = None) -> Needs:
    """One bundle per actor: cluster.num_actors of them, or `count` (e.g. num_actors + 1 with a learner)."""
    bundle = {"CPU": float(cluster.cpus_per_actor), "GPU": float(cluster.gpus_per_actor)}
    n = cluster.num_actors if count is None else count
    extra = n - cluster.num_actors
    who = f"{n} actors (cluster.num_actors={cluster.num_actors} + {extra})" if extra else ""
    return Needs({k: v for k, v in bundle.items() if v > 0}, n, who)


def fit_problem(need: Needs, nodes: list[dict[str, float]]) -> str:
    """Why the actors cannot all be placed on these nodes (their total resources), or '' when they can.

    Pure: `nodes` is one resource dict per alive node. Checks the cluster's totals and that every bundle fits on
    one node; a bin-packing failure of several bundles is left to Ray's placement (it then waits).
    """
    names = {"GPU": ("GPUs", "gpus_per_actor"), "CPU": ("CPUs", "cpus_per_actor")}
    who = need.who or f"cluster.num_actors={need.num_actors}"
    for key, (label, field) in names.items():
        want = need.total.get(key, 0.0)
        have = sum(n.get(key, 0.0) for n in nodes)
        if want > have:
            return (
                f"{who} x cluster.{field}={_num(need.bundle[key])} needs "
                f"{_num(want)} {label}; the cluster has {_num(have)} on {len(nodes)} node(s). Lower "
                f"cluster.num_actors or cluster.{field}, add nodes with {label}, or on an autoscaling cluster "
                "set cluster.wait_for_resources_s= to wait for them"
            )
        largest = max((n.get(key, 0.0) for n in nodes), default=0.0)
        if need.bundle.get(key, 0.0) > largest:
            return (
                f"cluster.{field}={_num(need.bundle[key])}: each actor needs that many {label} on one node; the "
                f"largest node has {_num(largest)}. Lower cluster.{field} or add bigger nodes"
            )
    return ""


def check_fit(cluster: ClusterConfig, count: int | None = None) -> None:
    """Fail before any actor starts when the connected cluster cannot hold the actors."""
    import ray

    nodes = [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]
    problem = fit_problem(needs(cluster, count), nodes)
    if problem:
        raise ConfigError(problem)


class Placement:
    """The run's placement group and the per-rank options; `release()` frees its reserved resources."""

    def __init__(self, cluster: ClusterConfig, group: Any | None, count: int | None = None):
        self.cluster, self.group = cluster, group
        self.count = cluster.num_actors if count is None else count

    def options(self, rank: int) -> dict[str, Any]:
        return actor_options(self, rank)

    def state(self) -> str:
        """Ray's state of the placement group: CREATED when every bundle is reserved, RESCHEDULING after a node
        holding some was lost (until Ray finds room for them elsewhere), PENDING; '' without a group."""
        if self.group is None:
            return ""
        from ray.util import placement_group_table

        return str(placement_group_table(self.group).get("state", ""))

    def release(self) -> None:
        if self.group is not None:
            from ray.util import remove_placement_group

            remove_placement_group(self.group)
            self.group = None


def place(cluster: ClusterConfig, name: str = "es", count: int | None = None) -> Placement:
    """Check the fit, reserve one bundle per actor (cluster.num_actors, or `count`) with the configured strategy,
    and wait until it is ready."""
    import ray
    from ray.util import placement_group

    need = needs(cluster, count)
    if not need.bundle:  # actors that ask for nothing need no reservation (Ray refuses empty bundles)
        return Placement(cluster, None, need.num_actors)
    if not cluster.wait_for_resources_s:
        check_fit(cluster, count)
    strategy = {"pack": "PACK", "spread": "SPREAD"}[cluster.placement]
    group = placement_group(
        [dict(need.bundle) for _ in range(need.num_actors)],
        strategy=strategy,
        name=f"{name}-{time.strftime('%Y%m%d-%H%M%S')}",
    )
    timeout = cluster.wait_for_resources_s or BUSY_WAIT_S
    ready, _ = ray.wait([group.ready()], timeout=timeout)
    if not ready:
        from ray.util import remove_placement_group

        remove_placement_group(group)
        nodes = [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]
        problem = fit_problem(need, nodes) or (
            f"the cluster holds the {_describe(need.total)} the actors need, but they stayed in use by "
            "other jobs or actors (see `ray status`)"
        )
        raise ConfigError(f"the actors' resources were not reserved within {timeout:g} s: {problem}")
    return Placement(cluster, group, need.num_actors)


def actor_options(placement: Placement, rank: int) -> dict[str, Any]:
    """Ray `.options()` for the actor of `rank`: its CPUs/GPUs, inside bundle `rank` of the run's group.

    Child tasks are not captured: an actor's own helpers (vLLM's engine processes, grader pools) are not counted
    against its bundle.
    """
    cluster = placement.cluster
    opts: dict[str, Any] = {"num_cpus": cluster.cpus_per_actor, "num_gpus": cluster.gpus_per_actor}
    if placement.group is not None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not 0 <= rank < placement.count:
            raise ValueError(f"rank {rank} is outside the placement group's {placement.count} bundles")
        opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement.group, placement_group_bundle_index=rank, placement_group_capture_child_tasks=False
        )
    return opts


def _num(x: float) -> str:
    return f"{x:g}"


def _describe(total: dict[str, float]) -> str:
    return " and ".join(f"{_num(v)} {k}s" for k, v in total.items())
