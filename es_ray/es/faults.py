"""Fault injection inside an ES actor (the `faults.*` config group): tests use it, users rehearse with it.

A fault fires once: a replacement actor started during iteration t is immune to the faults of iterations up to
t (it gets t's work again), so a run with faults injected must end exactly where the same run without them ends.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from es_ray.es.config import ESFaultsConfig
from es_ray.runtime.ledger import process_peak_memory

if TYPE_CHECKING:
    from es_ray.engines.base import ReplicaHost

# Ray and torch are imported by the fault that needs them: the driver imports this module without them.

KILL_EXIT_CODE = 75


class FaultInjector:
    def __init__(self, cfg: ESFaultsConfig, rank: int, immune_through: int = -1):
        self.cfg = cfg
        self.armed = rank == cfg.actor_rank
        self.immune_through = immune_through

    def _fires(self, key: str, iteration: int) -> bool:
        return self.armed and getattr(self.cfg, key) == iteration > self.immune_through

    def before_evaluate(self, iteration: int) -> None:
        if self.cfg.actor_delay_s:
            time.sleep(self.cfg.actor_delay_s)
        if self._fires("hang_actor_at_iteration", iteration):
            time.sleep(10 * self.cfg.actor_timeout_s)  # the driver's timeout kills this process first

    def member_done(self, iteration: int, done: int, total: int) -> None:
        """Called after each evaluated member: the kill lands after the first one, mid-iteration."""
        if self.cfg.kill_actor_phase == "evaluate" and self._fires("kill_actor_at_iteration", iteration) and done == 1:
            self._kill(f"evaluating iteration {iteration} ({done}/{total} members done)")

    def before_update(self, iteration: int) -> None:
        if self.cfg.kill_actor_phase == "update" and self._fires("kill_actor_at_iteration", iteration):
            self._kill(f"before applying the update of iteration {iteration}")

    def after_update(self, iteration: int, replica: ReplicaHost) -> None:
        if self._fires("corrupt_replica_at_iteration", iteration):
            corrupt_one_bit(replica)

    def _kill(self, where: str) -> None:
        if self.cfg.kill_actor_by == "oom":
            raise_memory_kill(where)
        _die(where)


# Ray's memory monitor's message as the caller reads it (Ray 2.60's OutOfMemoryError), numbers of this process.
MEMORY_KILL = (
    "Task was killed due to the node running out of memory.\nMemory on the node (IP: 127.0.0.1, ID: "
    "faults) where the task (actor ID: faults, name=ESWorker.__init__, pid={pid}, memory used={rss:.2f}GB) "
    "was running was 23.10GB / 24.00GB (0.9625), which exceeds the memory usage threshold of 0.95. Ray "
    "killed this worker (ID: faults) because it was the most recently scheduled task.\nTop 10 memory "
    "users:\nPID\tMEM(GB)\tCOMMAND\n{pid}\t{rss:.2f}\tray::ESWorker.evaluate\n"
)


def raise_memory_kill(where: str) -> None:
    """Fail the call as Ray's memory monitor does (faults.kill_actor_by=oom): its exception type and message."""
    import ray

    rss = (process_peak_memory().get("peak_rss_bytes") or 0) / 2**30
    print(
        f"faults: actor process {os.getpid()} fails with Ray's OutOfMemoryError {where} "
        "(faults.kill_actor_at_iteration, faults.kill_actor_by=oom)",
        flush=True,
    )
    raise ray.exceptions.OutOfMemoryError(MEMORY_KILL.format(pid=os.getpid(), rss=rss))


def _die(where: str) -> None:
    print(f"faults: actor process {os.getpid()} exits {where} (faults.kill_actor_at_iteration)", flush=True)
    os._exit(KILL_EXIT_CODE)


def corrupt_one_bit(replica: ReplicaHost) -> str:
    """Flip the lowest mantissa bit of one master weight (through the replica's own state round trip)."""
    import torch

    state = replica.state_dict()
    name = sorted(state["master"])[0]
    flat = state["master"][name].view(-1)
    bits = flat[:1].clone().view(torch.int32)
    bits ^= 1
    flat[:1] = bits.view(torch.float32)
    replica.load_state_dict(state)
    return name
