"""The sharded learner's checkpointed AdamW moments (grpo.shards): a checkpoint whose ``shards/`` cannot be read is
refused in one line that says what to do (a CheckpointError, which the CLI shows without a traceback), whether it
holds the older torch.distributed.checkpoint layout or an incomplete set of moments files."""

from __future__ import annotations

import pytest

from es_ray.core.config import ConfigError
from es_ray.core.manifest import CheckpointError
from es_ray.grpo.shards import load_moments


def test_a_checkpoint_in_the_older_dcp_layout_is_refused_in_one_line_naming_what_to_do(tmp_path):
    shards = tmp_path / "step_000004" / "shards"
    shards.mkdir(parents=True)
    (shards / ".metadata").write_bytes(b"")  # what torch.distributed.checkpoint wrote for two ranks
    (shards / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(CheckpointError) as info:
        load_moments(shards, {})
    text = str(info.value)
    assert isinstance(info.value, ConfigError) and "\n" not in text
    assert "torch.distributed.checkpoint (DCP) layout" in text and "no longer reads" in text
    assert "with the es-ray version that wrote it" in text and "in a new run.dir" in text
    assert str(tmp_path / "step_000004") in text


def test_a_missing_rank_file_is_refused_in_one_line_naming_what_was_found_and_expected(tmp_path):
    shards = tmp_path / "step_000004" / "shards"
    shards.mkdir(parents=True)
    for rank in (0, 2):  # rank 1 of 3 missing
        (shards / f"moments-{rank}-of-3.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError) as info:
        load_moments(shards, {})
    text = str(info.value)
    assert "\n" not in text and "DCP" not in text
    assert "found for 2 ranks of world size 3" in text and "(1 missing, first [1])" in text
    assert f"move {tmp_path / 'step_000004'} aside to resume from an earlier checkpoint" in text


def test_a_complete_set_beside_a_stale_one_of_another_world_size_is_refused_not_mixed(tmp_path):
    """Files of an fsdp_size=1 save beside a complete fsdp_size=2 set: which rank's rows are which is ambiguous, so
    the load names both world sizes rather than reading whichever file sorted last."""
    shards = tmp_path / "step_000004" / "shards"
    shards.mkdir(parents=True)
    for name in ("moments-0-of-1", "moments-0-of-2", "moments-1-of-2"):
        (shards / f"{name}.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError) as info:
        load_moments(shards, {})
    text = str(info.value)
    assert "\n" not in text
    assert "1 rank of world size 1; 2 ranks of world size 2" in text and "every rank of one world size" in text


def test_a_rank_beyond_the_world_size_is_named(tmp_path):
    shards = tmp_path / "step_000004" / "shards"
    shards.mkdir(parents=True)
    for rank in (0, 1, 5):
        (shards / f"moments-{rank}-of-2.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"beyond the world size: \[5\]"):
        load_moments(shards, {})
