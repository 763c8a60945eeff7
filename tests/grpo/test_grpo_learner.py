"""The GRPO learner in-process on the tiny model: the KL to the frozen reference starts at 0 and grows, several
epochs per batch move the ratio away from 1 (old log-probs kept), gradient checkpointing gives the same step,
bf16_mixed keeps steps bf16 weights lose and stays close to fp32, the chunked LM head equals the unchunked one while
holding one chunk of logits, and the learner scores at the rollouts' sampling temperature."""

from __future__ import annotations

import pytest
import torch

from es_ray.grpo.config import to_grpo_config
from es_ray.grpo.learner import GRPOLearner


def batch(n=4, prompt=(1, 2, 3, 4, 5), length=5):
    g = torch.Generator().manual_seed(0)
    samples = [
        {"prompt_ids": list(prompt), "completion_ids": torch.randint(10, 1000, (length - i % 2,), generator=g).tolist()}
        for i in range(n)
    ]
    return samples, [1.0, -1.0, 0.5, -0.5][:n]


def learner(model_dir, **grpo):
    return GRPOLearner(
        to_grpo_config(
            {
                "model": {"path": str(model_dir)},
                "engine": {"threads": 1},
                "grpo": {"lr": 1e-2, "micro_batch_size": 2, **grpo},
            }
        )
    )


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
    """Distinct prompts, so both learners take the padded forward (checkpointing turns the key/value cache off, and
    with it the shared-prompt path: test_a_group_runs_its_prompt_once... compares those two paths)."""
    samples, adv = batch()
    for i, s in enumerate(samples):
        s["prompt_ids"] = s["prompt_ids"] + [20 + i]
    plain, ckpt = learner(tiny_model_dir), learner(tiny_model_dir, gradient_checkpointing=True)
    a, b = plain.train_step(samples, adv), ckpt.train_step(samples, adv)
    assert a["grpo/grad_norm"] == pytest.approx(b["grpo/grad_norm"], rel=1e-4)
    wa, wb = plain.weights(), ckpt.weights()
    assert all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wa)


def test_pure_bf16_is_refused_and_so_is_top_p_below_one():
    from es_ray.core.config import ConfigError

    with pytest.raises(ConfigError, match="grpo.dtype=bf16_mixed"):
        to_grpo_config({"grpo": {"dtype": "bfloat16"}})
    with pytest.raises(ConfigError, match="sampling.top_p=1.0"):
        to_grpo_config({"sampling": {"top_p": 0.9}})


def test_bf16_mixed_keeps_a_small_step_that_bf16_weights_lose(tiny_model_dir):
    """lr 1e-5 on weights of magnitude 1 (the RMSNorm gains start at 1.0): AdamW on a bf16 weight rounds the step
    away (bf16's spacing at 1 is 2^-7), while bf16_mixed's fp32 master moves by about lr."""
    w = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    w.grad = torch.full_like(w, 0.3)
    torch.optim.AdamW([w], lr=1e-5, weight_decay=0.0).step()
    assert torch.equal(w.detach(), torch.ones(8, dtype=torch.bfloat16))  # the step is lost

    lrn = learner(tiny_model_dir, dtype="bf16_mixed", lr=1e-5)
    gain = lrn.named["model.norm.weight"]
    assert gain.dtype == torch.float32 and torch.equal(gain, torch.ones_like(gain))
    lrn.train_step(*batch())
    step = (gain.detach() - 1.0).abs()
    assert 5e-6 < float(step.max()) <= 1.1e-5  # Adam's first step is ~lr per weight, kept in fp32


def scored(lrn, samples, adv, shared=False):
    """Log-probs [B, L-1], mask, and the gradient (flat) of the GRPO loss with old = current log-probs; ``shared``:
    through the learner's shared-prompt path (each distinct prompt run once), else the padded forward."""
    from es_ray.grpo.loss import grpo_loss

    ids, attn, mask = lrn._pad(samples)
    logp, _ = lrn._log_probs(lrn.model, ids, attn, mask, samples=samples if shared else None)
    lrn.optimizer.zero_grad(set_to_none=True)
    grpo_loss(logp, logp.detach() - 0.1, torch.tensor(adv, dtype=logp.dtype), mask, loss_type="dapo")[0].backward()
    return logp.detach(), mask, torch.cat([p.grad.flatten() for p in lrn.params])


def test_a_group_runs_its_prompt_once_with_the_same_log_probs_and_gradient(tiny_model_dir, monkeypatch):
    """Two groups of one prompt each and a prompt of its own in one micro-batch, completions of different lengths
    (one of a single token): the shared-prompt forward gives the padded forward's log-probs and gradient in float64
    to rounding, and counts each distinct prompt's tokens once. transformers' RMSNorm computes in float32 whatever
    the model's dtype, which leaves the gradients (summed over a prompt's rows in a different order on the two
    paths) float32 apart; the norm is kept in the model's dtype here, so the comparison is a float64 one."""
    from transformers.models.llama import modeling_llama

    from es_ray.grpo.learner import forwarded_tokens

    def rms_norm(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", rms_norm)

    a, b, c = batch(3, prompt=(1, 2, 3, 4, 5, 6))[0], batch(2, prompt=(7, 8, 9))[0], batch(1, prompt=(4, 4))[0]
    b[1]["completion_ids"] = b[1]["completion_ids"][:1]
    samples = [a[0], b[0], a[1], c[0], b[1], a[2]]
    adv = [1.0, -1.0, 0.5, -0.5, 0.25, 0.75]
    lrn = learner(tiny_model_dir)
    lrn.model.double()
    assert lrn._shares_prompts(samples) and not lrn._shares_prompts([a[0], b[0], c[0]])
    lp_pad, mask, g_pad = scored(lrn, samples, adv)
    lp_shared, _, g_shared = scored(lrn, samples, adv, shared=True)
    assert torch.allclose(lp_shared, lp_pad, rtol=0, atol=1e-12)
    assert torch.allclose(g_shared, g_pad, rtol=1e-9, atol=1e-13) and g_pad.abs().max() > 0
    completions = sum(len(x["completion_ids"]) for x in samples)
    assert forwarded_tokens(samples, False) == 3 * 6 + 2 * 3 + 2 + completions
    assert forwarded_tokens(samples, True) == 6 + 3 + 2 + completions - len(samples)


def test_bf16_mixed_log_probs_and_gradient_are_close_to_float32(tiny_model_dir):
    """bf16 keeps 8 significant bits, so each rounding is within 2^-8 ~ 4e-3 relative, and independent roundings
    partly cancel; the tiny model's forward and backward go through a handful of rounded matmuls, so 1e-2 relative
    is the bar (measured: 4e-3 on the gradient, 1.3e-3 nats on log-probs of ~ -10.8, i.e. 1.2e-4 relative)."""
    samples, adv = batch()
    lp32, mask, g32 = scored(learner(tiny_model_dir), samples, adv)
    lp16, _, g16 = scored(learner(tiny_model_dir, dtype="bf16_mixed"), samples, adv)
    on = mask.bool()
    diff = (lp32[on] - lp16[on]).abs().max()
    assert 0 < diff <= 1e-2 * lp32[on].abs().max()  # bf16 compute happened, and stays close
    assert float((g32 - g16).norm() / g32.norm()) < 1e-2


def test_chunked_log_probs_equal_unchunked_and_hold_one_chunk_of_logits(tiny_model_dir):
    """grpo.logit_chunk_tokens=3 against one chunk for all N completion positions, in float64: the same log-probs
    and gradients to rounding, and the largest logits tensor (forward, and the recompute in the backward pass) is
    3 x V, not N x V."""
    samples, adv = batch()
    largest = {}
    results = {}
    for chunk in (3, 10_000):
        lrn = learner(tiny_model_dir, logit_chunk_tokens=chunk)
        lrn.model.double()
        head = lrn.model.get_output_embeddings()
        largest[chunk] = 0
        hook = head.register_forward_hook(
            lambda m, i, out, c=chunk: largest.__setitem__(c, max(largest[c], out.numel()))
        )
        results[chunk] = scored(lrn, samples, adv)
        hook.remove()
    (lp_a, mask, g_a), (lp_b, _, g_b) = results[3], results[10_000]
    vocab = head.weight.shape[0]
    n = int(mask.sum())
    assert n > 3 and largest == {3: 3 * vocab, 10_000: n * vocab}
    assert lp_a.dtype == g_a.dtype == torch.float64
    assert torch.allclose(lp_a, lp_b, rtol=0, atol=1e-12)
    assert torch.allclose(g_a, g_b, rtol=1e-10, atol=1e-14)


def test_learner_log_probs_are_the_engines_at_the_sampling_temperature(tiny_model_dir):
    """Rollouts sampled at T = 0.7 (transformers engine, fp32): the learner's log-probs of the sampled tokens, in a
    padded training batch, equal the engine's token_logprobs(..., temperature=0.7) within 1e-4; taken at T = 1
    instead they are off by far more, so the temperature is applied, not ignored."""
    from es_ray.grpo.rollout import RolloutWorker

    cfg = {
        "model": {"path": str(tiny_model_dir)},
        "engine": {"threads": 1},
        "sampling": {"max_new_tokens": 6, "temperature": 0.7},
    }
    rollout = RolloutWorker(to_grpo_config(cfg))
    samples = rollout.generate([0, 1], 2, seed=5)["samples"]
    engine = [rollout.engine.token_logprobs(s["prompt_ids"], s["completion_ids"], 0.7) for s in samples]

    def learner_lp(temperature):
        lrn = GRPOLearner(to_grpo_config({**cfg, "sampling": {**cfg["sampling"], "temperature": temperature}}))
        ids, attn, mask = lrn._pad(samples)
        with torch.no_grad():
            logp = lrn._log_probs(lrn.model, ids, attn, mask)[0]
        return [logp[b][mask[b].bool()].tolist() for b in range(len(samples))]

    def worst(lps):
        return max(abs(a - b) for mine, theirs in zip(lps, engine) for a, b in zip(mine, theirs))

    assert worst(learner_lp(0.7)) <= 1e-4
    assert worst(learner_lp(1.0)) > 0.05
