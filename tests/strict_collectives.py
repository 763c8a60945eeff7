"""A strict stand-in for NCCL's device rule on a CPU machine (gloo underneath).

NCCL serves only tensors on the rank's device; gloo takes CPU tensors, so on a CPU box a tensor the learner builds
without naming its device reaches a collective and works, and the same line crashes on the first GPU step. Here the
rank is given a device of its own, ``RANK_DEVICE`` (``cpu:0``: a CPU tensor in every other respect), and a
``TorchFunctionMode`` follows where each tensor the project's code (grpo/, es_ray/) makes would live on a GPU node:

* made without a device (``torch.tensor(...)``, ``torch.zeros(...)``), with ``device="cpu"``, or by ``.cpu()`` /
  ``.to("cpu")``: on the host;
* made with ``device=RANK_DEVICE`` or moved by ``.to(RANK_DEVICE)``: on the device;
* computed from host tensors only: on the host (as a CPU op's result is on a GPU node);
* FSDP2's shards and gradients under ``CPUOffloadPolicy`` (grpo.offload=all): on the host, as FSDP2 keeps them on a
  GPU node (every ``FSDPParam`` built while the mode is on is recorded; a DTensor whose local tensor shares their
  storage is a host DTensor);
* a DTensor computed from host DTensors only: on the host, and so is every tensor a collective is handed while such
  an op or a host DTensor's ``redistribute`` / ``full_tensor`` runs: DTensor's redistribution reduces or gathers the
  local (host) tensor (torch ``distributed/tensor/_redistribute.py``, ``placement_types.py``);
* anything else (a parameter transformers loaded, FSDP2's buffers, a device DTensor's shard): not followed. Torch's
  own collectives take their device from the group's mesh, which the learner's device names.

A move across the two devices returns a copy (as it does on a GPU node), so a host tensor and its device copy are
two tensors. The collectives of ``torch.distributed`` and of its functional API (what DTensor's ``full_tensor`` and
``distribute_tensor`` and FSDP2 call) accept a host tensor only on a group the project built with a CPU backend beside
the device's, as it builds it on a GPU node (``es_ray.runtime.process_group.backend_kinds("cuda")``, for a group in
its ``GROUP_BACKENDS``); anywhere else (torch's default group, a group with NCCL alone) they refuse it with the call
site in the project and where the tensor was made, as NCCL does ("No backend type associated with device type cpu").
``StrictDevice.checked`` counts the tensors each collective was handed and ``StrictDevice.host_served`` the host
tensors a CPU backend took, so a test can show the rule was applied.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

RANK_DEVICE = torch.device("cpu", 0)
"""The device a strict rank is given: distinct from the host's ``cpu`` as a name, the same memory underneath."""
REPO = Path(__file__).resolve().parents[1]
PROJECT = tuple(str(REPO / p) + "/" for p in ("grpo", "es_ray"))
TORCH = str(Path(torch.__file__).parent) + "/"
HERE = str(Path(__file__).resolve())
OVERRIDES = TORCH + "overrides.py"
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "broadcast",
    "scatter",
    "reduce",
    "all_to_all_single",
    "all_gather_tensor",
    "all_gather_tensor_autograd",
    "reduce_scatter_tensor_autograd",
)
FACTORIES = {
    torch.tensor,
    torch.as_tensor,
    torch.from_numpy,
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.arange,
    torch.linspace,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.eye,
}
HOST, DEVICE = "host", "device"


class StrictCollectiveError(RuntimeError):
    """A collective was handed a tensor that would be on the host of a GPU node (NCCL refuses it there)."""


def _site(roots: tuple[str, ...], through_torch: bool = True) -> str | None:
    """file:line (function) of the innermost frame outside this module (and outside torch where ``through_torch``:
    the project's line that led to a collective), if it lies under ``roots``. Without ``through_torch`` a tensor
    torch makes for itself (FSDP2's buffers on the mesh's device) is not the project's."""
    frame = sys._getframe(2)
    skip = (lambda f: f.startswith(TORCH) or f == HERE) if through_torch else (lambda f: f in (HERE, OVERRIDES))
    while frame is not None and skip(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None or not frame.f_code.co_filename.startswith(roots):
        return None
    return f"{Path(frame.f_code.co_filename).relative_to(REPO)}:{frame.f_lineno} ({frame.f_code.co_name})"


def _placement(device) -> str:
    return DEVICE if device is not None and torch.device(device) == RANK_DEVICE else HOST


class StrictDevice(TorchFunctionMode):
    """Follows host/device placement of the project's tensors and checks every collective's tensors (see module)."""

    def __init__(self, roots: tuple[str, ...] = PROJECT):
        super().__init__()
        self.roots = roots
        self.where = WeakIdKeyDictionary()  # tensor -> (HOST | DEVICE, "file:line (function)" where it was made)
        self.checked: Counter = Counter()
        self.host_served: Counter = Counter()
        self._saved: list = []
        self._depth = 0
        self._host_ops = 0  # > 0 while an op on host DTensors (or their redistribution) runs
        self._offloaded: list = []  # FSDP2's FSDPParams with CPUOffloadPolicy (weakrefs)

    def _offloaded_storages(self) -> set[int]:
        """Storage addresses of FSDP2's host shards and gradients (grpo.offload=all), as they are now."""
        ptrs = set()
        for ref in self._offloaded:
            fp = ref()
            if fp is None:
                continue
            for t in (getattr(fp, "_sharded_param_data", None), getattr(fp.sharded_param, "grad", None)):
                local = getattr(t, "_local_tensor", t)
                if isinstance(local, torch.Tensor) and local.numel() and not local.is_meta:
                    ptrs.add(local.untyped_storage().data_ptr())
        return ptrs

    def placed(self, t) -> tuple[str, str] | None:
        """(HOST | DEVICE, where it was made) of a followed tensor, None for one not followed."""
        found = self.where.get(t)
        if found is not None:
            return found
        local = getattr(t, "_local_tensor", None)
        if local is None:
            return None
        found = self.where.get(local)
        if (
            found is None
            and self._offloaded
            and local.numel()
            and not local.is_meta
            and local.untyped_storage().data_ptr() in self._offloaded_storages()
        ):
            found = (HOST, "FSDP2's CPUOffloadPolicy (grpo.offload=all)")
        return found

    # -- placement ---------------------------------------------------------------------------------------------
    def _follow(self, func, args, kwargs):
        out = func(*args, **kwargs)
        if not isinstance(out, torch.Tensor):  # several tensors (torch._foreach_norm): followed as one op's results
            outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            tagged = [self.placed(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if outs and tagged and all(t is not None and t[0] == HOST for t in tagged):
                for t in outs:
                    if t not in self.where:
                        self.where[t] = tagged[0]
            return out
        name = getattr(func, "__name__", "")
        moved = None
        if name == "to":
            moved = next(
                (a for a in list(args[1:]) + [kwargs.get("device")] if isinstance(a, (str, torch.device))), None
            )
            moved = None if moved is None else _placement(moved)
        elif name == "cpu":
            moved = HOST
        if moved is not None:
            site = _site(self.roots, through_torch=False)
            if site is None:
                return out
            was = self.where.get(args[0], (DEVICE, ""))[0]
            if out is args[0] and was != moved:
                out = out.clone()  # across devices a move is a copy: the source keeps its placement
            self.where[out] = (moved, site)
            return out
        if "device" in kwargs or func in FACTORIES:
            site = _site(self.roots, through_torch=False)
            if site is not None:
                self.where[out] = (_placement(kwargs.get("device")), site)
            return out
        tagged = [self.placed(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if tagged and all(t is not None and t[0] == HOST for t in tagged) and out not in self.where:
            self.where[out] = tagged[0]  # a CPU op on host tensors gives a host tensor
        return out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        """An op on host DTensors runs with ``_host_ops`` raised: a redistribution inside it hands the collective
        the DTensors' local (host) tensors."""
        kwargs = kwargs or {}
        dtensors = [t for t in tree_leaves((args, kwargs)) if hasattr(t, "_local_tensor")]
        if dtensors and all((self.placed(t) or (DEVICE,))[0] == HOST for t in dtensors):
            self._host_ops += 1
            try:
                return self._follow(func, args, kwargs)
            finally:
                self._host_ops -= 1
        return self._follow(func, args, kwargs)

    # -- the collectives ---------------------------------------------------------------------------------------
    def check(self, collective: str, args, kwargs) -> None:
        host_ok = serves_host(_group_name(collective, args, kwargs))
        for t in tree_leaves((args, kwargs)):
            if not isinstance(t, torch.Tensor):
                continue
            self.checked[collective] += 1
            placed = self.placed(t)
            if placed is None and self._host_ops:
                placed = (HOST, "a host DTensor's redistribution")
            if placed is None or placed[0] != HOST:
                continue
            if host_ok:
                self.host_served[collective] += 1
                continue
            site = _site(self.roots) or "outside the project"
            raise StrictCollectiveError(
                f"{collective} at {site} was handed a {t.dtype} tensor {tuple(t.shape)} on the host (made at "
                f"{placed[1]}); NCCL serves only tensors on the rank's device (No backend type associated with "
                f"device type cpu): create it with device=<the rank's device> or move it there first, or give the "
                f"group a CPU backend beside NCCL"
            )

    def __enter__(self):
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol
        import torch.distributed.distributed_c10d as c10d

        wrapped: dict = {}  # one wrapper per real function, however many modules export it
        for module in (dist, c10d, funcol):
            for name in COLLECTIVES:
                real = getattr(module, name, None)
                if real is None:
                    continue
                if id(real) not in wrapped:
                    wrapped[id(real)] = self._strict(name, real)
                self._saved.append((module, name, real))
                setattr(module, name, wrapped[id(real)])
        self._follow_fsdp_and_dtensor()
        return super().__enter__()

    def _follow_fsdp_and_dtensor(self) -> None:
        """Record FSDP2's offloaded parameters as they are built, and run a host DTensor's ``redistribute`` and
        ``full_tensor`` (plain methods, which the mode does not see) as host ops."""
        import weakref

        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
        from torch.distributed.tensor import DTensor

        init = FSDPParam.__init__

        def recorded(fp, *args, **kwargs):
            init(fp, *args, **kwargs)
            if fp.offload_to_cpu:
                self._offloaded.append(weakref.ref(fp))

        self._saved.append((FSDPParam, "__init__", init))
        FSDPParam.__init__ = recorded
        for name in ("redistribute", "full_tensor"):
            real = getattr(DTensor, name)
            self._saved.append((DTensor, name, real))
            setattr(DTensor, name, self._host_method(real))

    def _host_method(self, real):
        def method(dt, *args, **kwargs):
            if (self.placed(dt) or (DEVICE,))[0] != HOST:
                return real(dt, *args, **kwargs)
            self._host_ops += 1
            try:
                return real(dt, *args, **kwargs)
            finally:
                self._host_ops -= 1

        return method

    def _strict(self, name: str, real):
        def strict(*args, **kwargs):
            if self._depth:  # a collective built on another (all_gather_single on all_gather_into_tensor)
                return real(*args, **kwargs)
            self.check(name, args, kwargs)
            self._depth += 1
            try:
                return real(*args, **kwargs)
            finally:
                self._depth -= 1

        return strict

    def __exit__(self, *exc):
        for module, name, real in reversed(self._saved):
            setattr(module, name, real)
        self._saved.clear()
        return super().__exit__(*exc)


def _group_name(collective: str, args, kwargs) -> str | None:
    """The name of the group a collective runs on (None: torch's default group): a ``ProcessGroup``, a
    ``DeviceMesh`` (or ``(mesh, dim)``) or a group's registered name, passed as ``group=`` or among the arguments."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import DeviceMesh

    from es_ray.runtime import process_group

    for a in [kwargs.get("group"), kwargs.get("group_name"), *args]:
        if isinstance(a, str) and a in getattr(process_group, "GROUP_BACKENDS", {}):
            return a
        if isinstance(a, dist.ProcessGroup):
            return a.group_name
        if isinstance(a, DeviceMesh) or (isinstance(a, tuple) and a and isinstance(a[0], DeviceMesh)):
            return funcol._resolve_group_name(a)
    return None


def serves_host(group_name: str | None) -> bool:
    """Whether the group takes host tensors on a GPU node: one the project built (``own_group``) whose backends
    there (``backend_kinds("cuda")``) include a CPU one. Torch's default group in these tests is NCCL alone."""
    from es_ray.runtime import process_group

    built = getattr(process_group, "GROUP_BACKENDS", {})
    kinds = getattr(process_group, "backend_kinds", None)
    return group_name in built and kinds is not None and "cpu" in kinds("cuda")


def run_rank(rank: int, world: int, address: str, cfg, out_dir: str, queue) -> None:
    """One learner rank under ``StrictDevice`` on ``RANK_DEVICE``: join, a train step (its gradients clipped), a
    weight sync (every chunk through full_tensor), a sharded save and load. Puts (rank, counts of checked tensors per
    collective, error, counts of host tensors a CPU backend served, the step's grad norm, whether the loaded weights
    equal the saved ones)."""
    import es_ray.engines.base as base

    base.resolve_device = lambda engine_cfg: str(RANK_DEVICE)  # the rank is told its device, as on a GPU node
    from es_ray.grpo.learner import GRPOLearner

    samples = [{"prompt_ids": [1, 2, 3, 4 + i % 2], "completion_ids": [10 + i, 20, 30 + i, 40]} for i in range(4)]
    error, grad_norm, same = None, None, None
    with StrictDevice() as strict:
        try:
            learner = GRPOLearner(cfg, rank, world)
            learner.join(address)
            grad_norm = learner.train_step(samples, [1.0, -1.0, 0.5, -0.5])["grpo/grad_norm"]
            synced = {}
            for k in range(len(learner.chunks)):
                synced.update(learner.weight_chunk(k, "float32"))
            learner.save(f"{out_dir}/step_1", {"step": 1})
            with torch.no_grad():
                for p in learner.params:
                    p.to_local().add_(1.0)  # changed, so the load must write every row back
            learner.load(f"{out_dir}/step_1")
            after = {}
            for k in range(len(learner.chunks)):
                after.update(learner.weight_chunk(k, "float32"))
            same = bool(synced) == (rank == 0) and all(torch.equal(synced[n], after[n]) for n in synced)
        except Exception as exc:  # reported to the test, which prints it
            error = f"{type(exc).__name__}: {exc}"
    queue.put((rank, dict(strict.checked), error, dict(strict.host_served), grad_norm, same))
