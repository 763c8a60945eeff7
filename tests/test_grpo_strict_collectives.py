"""Every tensor the sharded learner hands to a collective is on the rank's device: a learner step, a weight sync
(each chunk through full_tensor) and a sharded save and load, two gloo ranks under the strict stand-in for NCCL's
device rule (tests/strict_collectives.py). gloo alone takes CPU tensors, so without the stand-in a host tensor in a
collective passes here and crashes on the first GPU step."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from es_ray.grpo.config import to_grpo_config
from strict_collectives import RANK_DEVICE, StrictCollectiveError, StrictDevice, run_rank

ROOTS = (__file__,)


def test_stand_in_refuses_a_host_tensor_and_names_the_call_site():
    """The rule itself, no group needed (the check runs before the collective): a tensor made without a device is
    refused with where it was made and where it was handed over; the same tensor on the rank's device passes."""
    import torch.distributed as dist

    with StrictDevice(roots=ROOTS) as strict:
        host = torch.tensor([1.0, 2.0], dtype=torch.float64)
        with pytest.raises(StrictCollectiveError, match=r"all_reduce at tests/test_grpo_strict_collectives.py:\d+ "
                                                        r"\(test_stand_in.*made at tests/test_grpo_strict"):
            dist.all_reduce(host)
        with pytest.raises(StrictCollectiveError, match="on the host"):  # a host op's result stays on the host
            dist.all_reduce(host * 2)
        with pytest.raises(StrictCollectiveError, match="on the host"):
            dist.all_reduce(host.to(RANK_DEVICE).cpu())
        moved = host.to(RANK_DEVICE)
        assert moved is not host  # a move across devices copies, as on a GPU node
        for ok in (moved, moved * 2, torch.zeros(2, device=RANK_DEVICE)):
            with pytest.raises(ValueError, match="Default process group has not been initialized"):
                dist.all_reduce(ok)  # past the check: the real collective, which has no group here
        assert strict.checked["all_reduce"] == 6
    assert not getattr(dist.all_reduce, "_strict", False)  # the real collectives are back


def test_sharded_learner_step_sync_and_checkpoint_keep_collectives_on_the_device(tiny_model_dir, tmp_path):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
    cfg = to_grpo_config({"model": {"path": str(tiny_model_dir)}, "engine": {"threads": 1},
                          "grpo": {"lr": 1e-2, "micro_batch_size": 2, "prompts_per_step": 2, "group_size": 2,
                                   "fsdp_size": 2}})
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=run_rank, args=(rank, 2, address, cfg, str(tmp_path), queue)) for rank in range(2)]
    for p in procs:
        p.start()
    try:
        results = sorted(queue.get(timeout=240) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank, checked, error in results:
        assert error is None, f"rank {rank}: {error}"
        # the rule was applied where it matters: the step's statistics, FSDP2's gathers and reduce-scatters, the
        # sync's and the checkpoint's full_tensor gathers
        assert checked.get("all_reduce", 0) >= 1 and checked.get("all_gather_single", 0) > 0, checked
        assert checked.get("reduce_scatter_single", 0) > 0, checked
    assert (tmp_path / "step_1" / "shards").is_dir()
