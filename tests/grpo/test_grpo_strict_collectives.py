"""Every tensor the sharded learner hands to a collective is on the rank's device: a learner step, a weight sync
(each chunk through full_tensor) and a sharded save and load, two gloo ranks under the strict stand-in for NCCL's
device rule (tests/strict_collectives.py). gloo alone takes CPU tensors, so without the stand-in a host tensor in a
collective passes here and crashes on the first GPU step."""

from __future__ import annotations

import pytest
import torch

from helpers import run_two_learner_ranks
from strict_collectives import RANK_DEVICE, StrictCollectiveError, StrictDevice, run_rank, serves_host

ROOTS = (__file__,)


def test_stand_in_refuses_a_host_tensor_and_names_the_call_site():
    """The rule itself, no group needed (the check runs before the collective): a tensor made without a device is
    refused with where it was made and where it was handed over; the same tensor on the rank's device passes."""
    import torch.distributed as dist

    with StrictDevice(roots=ROOTS) as strict:
        host = torch.tensor([1.0, 2.0], dtype=torch.float64)
        with pytest.raises(
            StrictCollectiveError,
            match=r"all_reduce at tests/grpo/test_grpo_strict_collectives.py:\d+ "
            r"\(test_stand_in.*made at tests/grpo/test_grpo_strict",
        ):
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
    for rank, checked, error, host_served, grad_norm, same in results:
        assert error is None, f"rank {rank}: {error}"
        assert not host_served, host_served  # offload=none: nothing reaches the group from the host
        assert grad_norm > 0 and same
        # the rule was applied where it matters: the step's statistics, FSDP2's gathers and reduce-scatters, the
        # sync's and the checkpoint's full_tensor gathers
        assert checked.get("all_reduce", 0) >= 1 and checked.get("all_gather_single", 0) > 0, checked
        assert checked.get("reduce_scatter_single", 0) > 0, checked
    assert (tmp_path / "step_1" / "shards").is_dir()


def test_offloaded_sharded_learner_clips_syncs_and_checkpoints_through_the_cpu_backend(tiny_model_dir, tmp_path):
    """grpo.offload=all over two ranks: FSDP2 keeps the shards and gradients on the host, so clip_grad_norm_'s
    partial norm and every full_tensor() (sync, save) hand host tensors to the learner's group. On a GPU node a
    group with NCCL alone refuses them; the group's CPU backend (gloo) must serve them."""
    results = run_two_learner_ranks(run_rank, tiny_model_dir, tmp_path, offload="all", max_grad_norm=1e-3)
    for rank, checked, error, host_served, grad_norm, same in results:
        assert error is None, f"rank {rank}: {error}"
        # the host tensors went to the CPU backend: the clip's all-reduce, the sync's and the save's all-gathers
        assert host_served.get("all_reduce", 0) >= 1, host_served
        assert host_served.get("all_gather_into_tensor", 0) + host_served.get("all_gather_single", 0) > 0, host_served
        assert grad_norm > 1e-3 and same, (grad_norm, same)  # clipped (the norm above the bound), reloaded exactly
    assert results[0][4] == results[1][4]  # one global norm, every rank's rows counted
    assert (tmp_path / "step_1" / "shards").is_dir()


def test_stand_in_serves_host_tensors_only_on_a_group_with_a_cpu_backend(tmp_path):
    """The rule over groups: the learner's own group (built as on a GPU node, with gloo beside NCCL) takes a host
    tensor; torch's default group (NCCL alone here) refuses it."""
    import socket

    import torch.distributed as dist

    from es_ray.runtime.process_group import own_group

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    group = own_group(f"tcp://127.0.0.1:{port}", 0, 1, str(RANK_DEVICE), 30, name="strict-host-test")
    try:
        assert serves_host(group.name) and not serves_host(None)
        with StrictDevice(roots=ROOTS) as strict:
            host = torch.tensor([1.0, 2.0])
            dist.all_reduce(host, group=group.pg)  # gloo beside NCCL: served
            assert strict.host_served["all_reduce"] == 1
            with pytest.raises(StrictCollectiveError, match="No backend type associated with device type cpu"):
                dist.all_reduce(host)  # the default group: NCCL alone
    finally:
        group.close()
