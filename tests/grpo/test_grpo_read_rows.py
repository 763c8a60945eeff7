"""GRPOLearner._read_rows (the sharded build and every resume): each parameter is read from its own tensor in the
directory; only a tied LM head is read from the embedding, and any other tensor the directory lacks is refused by
name. A fallback to the embedding for every missing name read its rows into a same-shaped shard (q_proj, o_proj at
grpo.fsdp_size>1) silently."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from es_ray.core.manifest import CheckpointError
from es_ray.grpo.config import to_grpo_config
from es_ray.grpo.learner import GRPOLearner, tied_key

MISSING = "model.layers.0.self_attn.q_proj.weight"


def learner(model_dir) -> GRPOLearner:
    return GRPOLearner(
        to_grpo_config(
            {
                "model": {"path": str(model_dir)},
                "engine": {"threads": 1},
                "grpo": {"micro_batch_size": 2, "prompts_per_step": 2, "group_size": 2},
            }
        )
    )


def write_dir(path, weights: dict) -> None:
    path.mkdir()
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))


def test_only_a_tied_lm_head_falls_back_to_the_embedding():
    index = {"model.embed_tokens.weight": ("f", (8, 4)), "model.norm.weight": ("f", (4,))}
    assert tied_key("lm_head.weight", index, tied=True) == "model.embed_tokens.weight"
    assert tied_key("lm_head.weight", index, tied=False) == "lm_head.weight"  # untied: its own tensor or nothing
    assert tied_key(MISSING, index, tied=True) == MISSING  # never the embedding's rows
    assert tied_key("model.norm.weight", index, tied=True) == "model.norm.weight"


def test_a_directory_missing_a_tensor_is_refused_naming_it(tiny_model_dir, tmp_path):
    one = learner(tiny_model_dir)
    weights = {n: p.detach().clone() for n, p in one.named.items()}
    assert "lm_head.weight" not in weights  # tied: saved once, as the embedding
    write_dir(tmp_path / "whole", {n: w + 1 for n, w in weights.items()})
    one._read_rows(tmp_path / "whole")  # every tensor there: each read into its own parameter
    for n, p in one.named.items():
        assert torch.equal(p.detach(), weights[n] + 1), n
    del weights[MISSING]
    write_dir(tmp_path / "short", weights)
    with pytest.raises(CheckpointError, match=rf"no tensor '{MISSING}'"):
        one._read_rows(tmp_path / "short")
