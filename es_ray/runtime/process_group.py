"""A process group of its own for a set of ranks (the sharded GRPO learner's), and never torch's default group, so
that an engine in the same process may own that one: vLLM's in-process worker calls ``init_process_group`` for its
world of one (grpo.colocate=true with engine.name=vllm), and a second ``init_process_group`` raises "trying to
initialize the default process group twice".

The group is built from a TCPStore at rank 0's address the way torch builds any group (a ``ProcessGroup`` with one
backend per device type, ``backend_kinds``: NCCL for CUDA tensors and gloo beside it for host ones, as
``init_process_group("cpu:gloo,cuda:nccl")`` would; gloo alone on a CPU rank), registered by name only, which is how
DTensor's and FSDP2's
collectives find it. It is not entered in torch's table of groups: that table maps a group's ranks through the
default group's rank (``dist.get_rank(group)``), which under vLLM is 0 in every process. So the code over this
group uses only what reads the group itself: ``group.rank()``, collectives given ``group=``, object collectives
given ``group_src=``, and the ``DeviceMesh`` built here, whose coordinate is this rank's place in the group
(``DeviceMesh.from_group`` would read it from the default group). What this excludes is listed in docs/gpu-nodes.md
("Its own process group").
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

# torch.distributed is imported inside these functions: they run in the learner's actors, and this module is imported
# without torch.


@dataclass
class OwnGroup:
    """``pg``: the ``ProcessGroup`` (its ``rank()`` and ``size()`` are this rank's place and the world); ``mesh``: the
    1-D ``DeviceMesh`` over it for ``fully_shard`` and DTensor; ``store``: the TCPStore it was built from (kept
    alive with the group)."""

    pg: Any
    mesh: Any
    store: Any
    name: str
    device: Any
    backends: dict[str, str]
    """Device type -> the backend serving that type's tensors (``backend_kinds``)."""

    @property
    def rank(self) -> int:
        return self.pg.rank()

    def barrier(self) -> None:
        """Every rank reaches this line: a one-element all-reduce on the group's device (NCCL's barrier would guess
        the device)."""
        import torch
        import torch.distributed as dist

        dist.all_reduce(torch.zeros(1, device=self.device), group=self.pg)

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (pickled)."""
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, group=self.pg, group_src=0)
        return box[0]

    def close(self) -> None:
        """Shut the backend down and forget the name (a later group may take it)."""
        from torch._C._distributed_c10d import _unregister_process_group

        self.pg.shutdown()
        _unregister_process_group(self.name)
        GROUP_BACKENDS.pop(self.name, None)


def backend_kinds(device_type: str) -> dict[str, str]:
    """Device type -> backend of the learner's group on a rank whose device is of ``device_type``: its own (NCCL for
    cuda, gloo for cpu) and gloo for the host's tensors beside it. Host tensors do reach the group on a GPU node:
    with grpo.offload=all FSDP2 keeps the shards and gradients on the host, so ``clip_grad_norm_``'s partial norm and
    ``full_tensor()`` (the weight sync, the checkpoint) are all-reduces and all-gathers of CPU tensors; a group with
    NCCL alone refuses them ("No backend type associated with device type cpu", pytorch#148532)."""
    return {"cpu": "GLOO", "cuda": "NCCL"} if device_type == "cuda" else {"cpu": "GLOO"}


GROUP_BACKENDS: dict[str, dict[str, str]] = {}
"""Group name -> ``backend_kinds`` of the groups ``own_group`` built in this process (tests/strict_collectives.py
reads it to decide which tensors a group serves on a GPU node)."""


def own_group(address: str, rank: int, world: int, device: str, timeout_s: float, name: str) -> OwnGroup:
    """Rank ``rank`` of ``world`` joins the group whose TCPStore rank 0 serves at ``address`` (tcp://host:port);
    ``device``: the rank's device (``backend_kinds``: NCCL and gloo for CUDA, gloo for CPU). ``name`` must be unique in
    the process."""
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import _register_process_group
    from torch.distributed.device_mesh import DeviceMesh

    url = urlparse(address)
    if url.scheme != "tcp" or not url.hostname or not url.port:
        raise ValueError(f"process group address {address!r}: expected tcp://host:port")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(url.hostname, url.port, world, is_master=rank == 0, timeout=timeout)
    prefix = dist.PrefixStore(f"{name}/", store)
    dev = torch.device(device)
    pg = dist.ProcessGroup(prefix, rank, world)
    kinds = backend_kinds(dev.type)
    for device_type, kind in kinds.items():
        if kind == "NCCL":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            options.group_name = name
            options.global_ranks_in_group = list(range(world))
            backend = dist.ProcessGroupNCCL(dist.PrefixStore("cuda/", prefix), rank, world, options)
        else:
            backend = dist.ProcessGroupGloo(dist.PrefixStore("cpu/", prefix), rank, world, timeout)
        backend._set_sequence_number_for_group()
        pg._register_backend(torch.device(device_type), getattr(dist.ProcessGroup.BackendType, kind), backend)
    pg._set_default_backend(getattr(dist.ProcessGroup.BackendType, kinds[dev.type]))  # the device's
    pg._set_group_name(name)
    _register_process_group(name, pg)  # by name: DTensor's functional collectives resolve the mesh's group so
    # What DeviceMesh.from_group builds, with this rank's coordinate given rather than read from the default group
    mesh = DeviceMesh(dev.type, torch.arange(world), _init_backend=False, _rank=rank)
    mesh._dim_group_names = [name]
    mesh._pg_registry[name] = pg
    GROUP_BACKENDS[name] = kinds
    return OwnGroup(pg, mesh, store, name, dev, kinds)
