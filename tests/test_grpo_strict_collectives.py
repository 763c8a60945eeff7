"""Every tensor the sharded learner hands to a collective is on the rank's device: a learner step, a weight sync
(each chunk through full_tensor) and a sharded save and load, two gloo ranks under the strict stand-in for NCCL's
device rule (tests/strict_collectives.py). gloo alone takes CPU tensors, so without the stand-in a host tensor in a
collective passes here and crashes on the first GPU step."""

from __future__ import annotations

import pytest
import torch

from helpers import run_two_learner_ranks
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
    results = run_two_learner_ranks(run_rank, tiny_model_dir, tmp_path)
    for rank, checked, error in results:
        assert error is None, f"rank {rank}: {error}"
        # the rule was applied where it matters: the step's statistics, FSDP2's gathers and reduce-scatters, the
        # sync's and the checkpoint's full_tensor gathers
        assert checked.get("all_reduce", 0) >= 1 and checked.get("all_gather_single", 0) > 0, checked
        assert checked.get("reduce_scatter_single", 0) > 0, checked
    assert (tmp_path / "step_1" / "shards").is_dir()
