"""grpo.loss against a plain numpy reference on fixed small tensors (unit tier: no Ray, no model)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from es_ray.grpo.loss import aggregate, group_advantages, grpo_loss, k3_kl

# 3 sequences, up to 4 completion tokens; sequence 1 has 2 tokens, sequence 2 has 3 (padding masked out).
MASK = np.array([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]], dtype=np.float64)
OLD = np.log(np.array([[0.5, 0.4, 0.3, 0.2], [0.6, 0.5, 0.9, 0.9], [0.1, 0.2, 0.3, 0.9]]))
# ratios: seq 0 -> 1.5 (above 1 + 0.2), 0.7 (below 1 - 0.2), 1.1, 1.0; seq 1 -> 0.5, 1.25, pad; seq 2 -> 1.3, 0.75, 1.0
RATIO = np.array([[1.5, 0.7, 1.1, 1.0], [0.5, 1.25, 3.0, 3.0], [1.3, 0.75, 1.0, 3.0]])
NEW = OLD + np.log(RATIO)
REF = OLD + np.array([[0.1, -0.2, 0.0, 0.3], [0.05, 0.0, 5.0, 5.0], [-0.1, 0.2, 0.4, 5.0]])
ADV = np.array([1.0, -2.0, 0.5])


def reference(loss_type, clip_eps=0.2, clip_high=None, beta=0.0, max_tokens=4):
    """Token by token, written out: -min(r A, clip(r) A) + beta * (exp(ref - new) - (ref - new) - 1)."""
    high = clip_high if clip_high else clip_eps
    per_token = np.zeros_like(NEW)
    for i in range(3):
        for t in range(4):
            r = RATIO[i, t]
            surr = min(r * ADV[i], min(max(r, 1 - clip_eps), 1 + high) * ADV[i])
            d = REF[i, t] - NEW[i, t]
            per_token[i, t] = -surr + beta * (np.exp(d) - d - 1)
    masked = per_token * MASK
    if loss_type == "grpo":
        return np.mean(masked.sum(1) / MASK.sum(1))
    if loss_type == "dr_grpo":
        return masked.sum() / (3 * max_tokens)
    return masked.sum() / MASK.sum()


def run(loss_type, **kw):
    t = lambda a: torch.tensor(a, dtype=torch.float64)  # noqa: E731
    return grpo_loss(t(NEW), t(OLD), t(ADV), t(MASK), loss_type=loss_type, ref_logp_bt=t(REF), max_tokens=4, **kw)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_each_loss_type_matches_the_numpy_reference(loss_type, beta):
    loss, _ = run(loss_type, beta=beta)
    assert float(loss) == pytest.approx(reference(loss_type, beta=beta), rel=1e-12, abs=1e-12)


def test_the_three_aggregations_differ_on_unequal_lengths():
    values = {lt: float(run(lt)[0]) for lt in ("grpo", "dr_grpo", "dapo")}
    assert len({round(v, 9) for v in values.values()}) == 3


def test_clipping_on_both_sides_and_clip_fraction():
    # A > 0 clips ratios above 1.2 (seq 0: 1.5; seq 2: 1.3); A < 0 clips ratios below 0.8 (seq 1: 0.5).
    # seq 0 token 1 (0.7 with A > 0) and seq 2 token 1 (0.75 with A > 0) are below, but min() keeps r A: not clipped.
    loss, stats = run("dapo")
    assert float(stats["clipped_tokens"]) == 3 and float(stats["tokens"]) == 9
    # clip_eps_high=0.4 stops clipping 1.3 (seq 2) but still clips 1.5 (seq 0)
    loss_high, stats_high = run("dapo", clip_eps_high=0.4)
    assert float(stats_high["clipped_tokens"]) == 2
    assert float(loss_high) == pytest.approx(reference("dapo", clip_high=0.4), rel=1e-12)
    assert float(loss_high) != pytest.approx(float(loss))


def test_clipped_tokens_carry_no_gradient():
    new = torch.tensor(NEW, requires_grad=True)
    t = lambda a: torch.tensor(a, dtype=torch.float64)  # noqa: E731
    loss, _ = grpo_loss(new, t(OLD), t(ADV), t(MASK), loss_type="dapo")
    loss.backward()
    grad = new.grad.numpy()
    assert grad[0, 0] == 0 and grad[1, 0] == 0 and grad[2, 0] == 0  # the three clipped tokens
    assert np.all(grad[MASK == 0] == 0)  # padding
    # unclipped token: d/dlogp of -r A / M = -r A / M
    assert grad[0, 2] == pytest.approx(-1.1 * 1.0 / 9)


def test_padding_does_not_change_the_loss():
    t = lambda a: torch.tensor(a, dtype=torch.float64)  # noqa: E731
    garbage_new, garbage_old = NEW.copy(), OLD.copy()
    garbage_new[MASK == 0] = 123.0
    garbage_old[MASK == 0] = -50.0
    for lt in ("grpo", "dr_grpo", "dapo"):
        a = grpo_loss(t(NEW), t(OLD), t(ADV), t(MASK), loss_type=lt, beta=0.1, ref_logp_bt=t(REF), max_tokens=4)[0]
        b = grpo_loss(
            t(garbage_new), t(garbage_old), t(ADV), t(MASK), loss_type=lt, beta=0.1, ref_logp_bt=t(REF), max_tokens=4
        )[0]
        assert torch.isfinite(b) and float(a) == pytest.approx(float(b), rel=1e-12)


def test_k3_kl_matches_formula_and_is_zero_at_equal_policies():
    new, ref = torch.tensor(NEW), torch.tensor(REF)
    d = REF - NEW
    np.testing.assert_allclose(k3_kl(new, ref).numpy(), np.exp(d) - d - 1, rtol=1e-12)
    assert torch.all(k3_kl(new, ref) >= 0)
    assert torch.all(k3_kl(new, new) == 0)
    _, stats = run("dapo", beta=0.1)
    assert float(stats["kl_sum"]) == pytest.approx(((np.exp(d) - d - 1) * MASK).sum(), rel=1e-12)


def test_micro_batches_add_up_to_the_batch_loss():
    t = lambda a: torch.tensor(a, dtype=torch.float64)  # noqa: E731
    for lt in ("grpo", "dr_grpo", "dapo"):
        whole = float(run(lt, beta=0.1)[0])
        parts = sum(
            float(
                grpo_loss(
                    t(NEW[s]),
                    t(OLD[s]),
                    t(ADV[s]),
                    t(MASK[s]),
                    loss_type=lt,
                    beta=0.1,
                    ref_logp_bt=t(REF[s]),
                    max_tokens=4,
                    num_sequences=3,
                    num_tokens=MASK.sum(),
                )[0]
            )
            for s in (slice(0, 1), slice(1, 3))
        )
        assert parts == pytest.approx(whole, rel=1e-12)


def test_group_advantages_match_numpy_and_zero_std_groups_give_zero():
    r = np.array([[1.0, 0.0, 0.5, 0.5], [0.3, 0.3, 0.3, 0.3], [0.0, 1.0, 0.0, 0.0]])
    eps = 1e-6
    expect = (r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + eps)
    got = group_advantages(torch.tensor(r), "group", eps).numpy()
    np.testing.assert_allclose(got, expect, rtol=1e-12)
    assert np.all(got[1] == 0) and np.all(np.isfinite(got))
    np.testing.assert_allclose(
        group_advantages(torch.tensor(r), "batch", eps).numpy(),
        (r - r.mean(1, keepdims=True)) / (r.std() + eps),
        rtol=1e-12,
    )
    np.testing.assert_allclose(group_advantages(torch.tensor(r), "none").numpy(), r - r.mean(1, keepdims=True))
    all_equal = group_advantages(torch.zeros(2, 4), "batch")
    assert torch.all(all_equal == 0)


def test_unknown_options_are_refused():
    with pytest.raises(ValueError, match="loss_type"):
        aggregate(torch.zeros(1, 1), torch.ones(1, 1), "ppo", 1)
    with pytest.raises(ValueError, match="scale"):
        group_advantages(torch.zeros(1, 2), "rank")
    with pytest.raises(ValueError, match="ref"):
        grpo_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1), beta=0.1)


@pytest.mark.parametrize("chunk", [1, 4, 100])
def test_chunked_token_scores_match_the_whole_log_softmax_at_a_temperature(chunk):
    """The learner's chunked LM head (es_ray.metrics.entropy.chunked_token_scores) against log_softmax(h W^T / T) over
    all positions at once, in float64: log-probs, entropies and the gradients to h and W."""
    from es_ray.metrics.entropy import chunked_token_scores, entropy_from_logits

    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(6, 40, bias=False).double()
    hidden = torch.randn(9, 6, dtype=torch.float64, generator=g, requires_grad=True)
    tokens = torch.randint(0, 40, (9,), generator=g)
    weights = torch.rand(9, dtype=torch.float64, generator=g)
    lp, ent = chunked_token_scores(head, hidden, tokens, 0.7, chunk, entropy=True)
    (lp * weights).sum().backward()
    got = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None
    logits = head(hidden) / 0.7
    want = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None])[:, 0]
    (want * weights).sum().backward()
    torch.testing.assert_close(lp, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, entropy_from_logits(head(hidden).detach(), 0.7).double(), rtol=1e-6, atol=1e-6)
    assert not ent.requires_grad
    torch.testing.assert_close(got[0], hidden.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1], head.weight.grad, rtol=1e-12, atol=1e-12)
