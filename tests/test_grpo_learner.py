"""The GRPO learner in-process on the tiny model: the KL to the frozen reference starts at 0 and grows, several
epochs per batch move the ratio away from 1 (old log-probs kept), and gradient checkpointing gives the same step."""

from __future__ import annotations

import pytest
import torch

from grpo.config import to_grpo_config


def batch(n=4, prompt=(1, 2, 3, 4, 5), length=5):
    g = torch.Generator().manual_seed(0)
    samples = [{"prompt_ids": list(prompt), "completion_ids": torch.randint(10, 1000, (length - i % 2,), generator=g)
                .tolist()} for i in range(n)]
    return samples, [1.0, -1.0, 0.5, -0.5][:n]


def learner(model_dir, **grpo):
    from grpo.learner import GRPOLearner

    return GRPOLearner(to_grpo_config({"model": {"path": str(model_dir)}, "engine": {"threads": 1},
                                       "grpo": {"lr": 1e-2, "micro_batch_size": 2, **grpo}}))


def test_kl_to_reference_starts_at_zero_and_grows(tiny_model_dir):
    lrn = learner(tiny_model_dir, beta=0.1)
    assert lrn.ready()["reference"]
    samples, adv = batch()
    first = lrn.train_step(samples, adv)
    second = lrn.train_step(samples, adv)
    assert first["grpo/kl"] == pytest.approx(0.0, abs=1e-6)
    assert second["grpo/kl"] > 1e-6


def test_epochs_per_batch_use_the_old_log_probs(tiny_model_dir):
    samples, adv = batch()
    one = learner(tiny_model_dir, epochs_per_batch=1).train_step(samples, adv)
    three = learner(tiny_model_dir, epochs_per_batch=3).train_step(samples, adv)
    assert one["grpo/ratio_mean"] == pytest.approx(1.0, abs=1e-6) and one["grpo/clip_frac"] == 0
    assert three["grpo/ratio_mean"] != pytest.approx(1.0, abs=1e-4)  # epochs 2 and 3 see moved weights
    assert three["tokens_backpropagated"] == 3 * one["tokens_backpropagated"]


def test_gradient_checkpointing_gives_the_same_step(tiny_model_dir):
    samples, adv = batch()
    plain, ckpt = learner(tiny_model_dir), learner(tiny_model_dir, gradient_checkpointing=True)
    a, b = plain.train_step(samples, adv), ckpt.train_step(samples, adv)
    assert a["grpo/grad_norm"] == pytest.approx(b["grpo/grad_norm"], rel=1e-4)
    wa, wb = plain.weights(), ckpt.weights()
    assert all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wa)
