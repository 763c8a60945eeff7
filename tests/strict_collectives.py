"""A strict stand-in for NCCL's device rule on a CPU machine (gloo underneath).

NCCL serves only tensors on the rank's device; gloo takes CPU tensors, so on a CPU box a tensor the learner builds
without naming its device reaches a collective and works, and the same line crashes on the first GPU step. Here the
rank is given a device of its own, ``RANK_DEVICE`` (``cpu:0``: a CPU tensor in every other respect), and a
``TorchFunctionMode`` follows where each tensor the project's code (grpo/, es_ray/) makes would live on a GPU node:

* made without a device (``torch.tensor(...)``, ``torch.zeros(...)``), with ``device="cpu"``, or by ``.cpu()`` /
  ``.to("cpu")``: on the host;
* made with ``device=RANK_DEVICE`` or moved by ``.to(RANK_DEVICE)``: on the device;
* computed from host tensors only: on the host (as a CPU op's result is on a GPU node);
* anything else (a parameter transformers loaded, FSDP2's buffers, a DTensor's shard): not followed. Torch's own
  collectives take their device from the group's mesh, which the learner's device names.

A move across the two devices returns a copy (as it does on a GPU node), so a host tensor and its device copy are
two tensors. The collectives of ``torch.distributed`` and of its functional API (what DTensor's ``full_tensor`` and
``distribute_tensor`` and FSDP2 call) refuse a host tensor with the call site in the project and where the tensor was
made. ``StrictDevice.checked`` counts the tensors each collective was handed, so a test can show the rule was applied.
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
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
               "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "scatter", "reduce", "all_to_all_single",
               "all_gather_tensor", "all_gather_tensor_autograd", "reduce_scatter_tensor_autograd")
FACTORIES = {torch.tensor, torch.as_tensor, torch.from_numpy, torch.zeros, torch.ones, torch.empty, torch.full,
             torch.arange, torch.linspace, torch.rand, torch.randn, torch.randint, torch.eye}
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
        self._saved: list = []
        self._depth = 0

    # -- placement ---------------------------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not isinstance(out, torch.Tensor):
            return out
        name = getattr(func, "__name__", "")
        moved = None
        if name == "to":
            moved = next((a for a in list(args[1:]) + [kwargs.get("device")]
                          if isinstance(a, (str, torch.device))), None)
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
        tagged = [self.where.get(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if tagged and all(t is not None and t[0] == HOST for t in tagged) and out not in self.where:
            self.where[out] = tagged[0]  # a CPU op on host tensors gives a host tensor
        return out

    # -- the collectives ---------------------------------------------------------------------------------------
    def check(self, collective: str, args, kwargs) -> None:
        for t in tree_leaves((args, kwargs)):
            if not isinstance(t, torch.Tensor):
                continue
            self.checked[collective] += 1
            placed = self.where.get(t)
            if placed is not None and placed[0] == HOST:
                site = _site(self.roots) or "outside the project"
                raise StrictCollectiveError(
                    f"{collective} at {site} was handed a {t.dtype} tensor {tuple(t.shape)} on the host (made at "
                    f"{placed[1]}); NCCL serves only tensors on the rank's device: create it with "
                    f"device=<the rank's device> or move it there first")

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
        return super().__enter__()

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


def run_rank(rank: int, world: int, address: str, cfg, out_dir: str, queue) -> None:
    """One learner rank under ``StrictDevice`` on ``RANK_DEVICE``: join, a train step, a weight sync (every chunk
    through full_tensor), a sharded save and load. Puts (rank, counts of checked tensors per collective, error)."""
    import es_ray.engines.base as base

    base.resolve_device = lambda engine_cfg: str(RANK_DEVICE)  # the rank is told its device, as on a GPU node
    from es_ray.grpo.learner import GRPOLearner

    samples = [{"prompt_ids": [1, 2, 3, 4 + i % 2], "completion_ids": [10 + i, 20, 30 + i, 40]} for i in range(4)]
    error = None
    with StrictDevice() as strict:
        try:
            learner = GRPOLearner(cfg, rank, world)
            learner.join(address)
            learner.train_step(samples, [1.0, -1.0, 0.5, -0.5])
            for k in range(len(learner.chunks)):
                learner.weight_chunk(k, "bfloat16")
            learner.save(f"{out_dir}/step_1", {"step": 1})
            learner.load(f"{out_dir}/step_1")
        except Exception as exc:  # reported to the test, which prints it
            error = f"{type(exc).__name__}: {exc}"
    queue.put((rank, dict(strict.checked), error))
