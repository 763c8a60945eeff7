"""Token entropy: closed forms, the teacher-forced pass against a full forward, and the summaries."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from es_ray.metrics.entropy import (
    HIST_EDGES,
    batched_completion_entropies,
    completion_entropies,
    entropy_from_logits,
    hist_quantile,
    histogram,
    nucleus_entropy_from_logits,
    summarize,
    summarize_stats,
)


def test_entropy_closed_forms():
    assert entropy_from_logits(torch.zeros(8)).item() == pytest.approx(math.log(8))
    assert entropy_from_logits(torch.tensor([1000.0, 0.0, 0.0])).item() == pytest.approx(0.0, abs=1e-6)
    p = torch.tensor([0.5, 0.25, 0.25])
    assert entropy_from_logits(p.log()).item() == pytest.approx(1.5 * math.log(2))
    batch = torch.zeros(2, 3, 4)
    assert entropy_from_logits(batch).shape == (2, 3)


def test_masked_tokens_with_minus_inf_logits_add_nothing():
    masked = torch.tensor([[1.0, 2.0, float("-inf"), 0.5], [float("-inf"), 0.0, float("-inf"), 0.0]])
    got = entropy_from_logits(masked, 0.7)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got[0], entropy_from_logits(torch.tensor([1.0, 2.0, 0.5]), 0.7))
    assert got[1].item() == pytest.approx(math.log(2))


@pytest.mark.parametrize("grad", [False, True])
def test_chunked_token_scores_entropy_with_masked_tokens_is_finite(grad):
    """The learner's chunked LM head with a -inf logit (a masked vocabulary entry, here a -inf bias): its entropy is
    the masked distribution's, not 0 * -inf = NaN, and the log-probs of the unmasked tokens and their gradients stay
    finite, with and without the checkpointed backward."""
    from es_ray.metrics.entropy import chunked_token_scores

    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(5, 7)
    with torch.no_grad():
        head.bias[[2, 5]] = float("-inf")
    hidden = torch.randn(6, 5, generator=g, requires_grad=grad)
    tokens = torch.tensor([0, 1, 3, 4, 6, 0])
    with torch.set_grad_enabled(grad):
        lp, ent = chunked_token_scores(head, hidden, tokens, 0.8, chunk=4, entropy=True)
    kept = [0, 1, 3, 4, 6]
    z = (hidden @ head.weight.T + head.bias).detach()[:, kept]
    torch.testing.assert_close(ent, entropy_from_logits(z, 0.8))
    torch.testing.assert_close(
        lp.detach(),
        torch.log_softmax(z / 0.8, -1).gather(-1, torch.tensor([kept.index(int(t)) for t in tokens])[:, None])[:, 0],
    )
    if grad:
        lp.sum().backward()
        assert torch.isfinite(hidden.grad).all() and torch.isfinite(head.weight.grad).all()


def test_temperature_rescales_the_logits():
    logits = torch.tensor([2.0, 0.5, -1.0, 0.0])
    assert entropy_from_logits(logits, 0.5).item() == pytest.approx(entropy_from_logits(2 * logits).item())
    assert entropy_from_logits(logits, 1e6).item() == pytest.approx(math.log(4), abs=1e-4)


def test_nucleus_entropy_is_the_entropy_of_what_top_p_samples():
    # p = (0.5, 0.25, 0.125, 0.125): top_p 0.7 keeps 0.5 and 0.25 (the one that crosses), renormalised to (2/3, 1/3)
    logits = torch.tensor([0.5, 0.25, 0.125, 0.125]).log()
    want = -(2 / 3 * math.log(2 / 3) + 1 / 3 * math.log(1 / 3))
    assert nucleus_entropy_from_logits(logits, 1.0, 0.7).item() == pytest.approx(want, rel=1e-6)
    assert nucleus_entropy_from_logits(logits, 1.0, 0.4).item() == pytest.approx(0.0, abs=1e-7)  # the top token
    assert nucleus_entropy_from_logits(logits, 1.0, 1.0).item() == pytest.approx(entropy_from_logits(logits).item())
    # the same nucleus as the sampler's own warper (transformers' TopPLogitsWarper), at a temperature
    from transformers.generation.logits_process import TopPLogitsWarper

    z = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3
    q = torch.softmax(TopPLogitsWarper(0.9)(None, z / 0.7), dim=-1)  # -inf outside the nucleus
    want = -torch.where(q > 0, q * q.log(), torch.zeros_like(q)).sum(dim=-1)
    torch.testing.assert_close(nucleus_entropy_from_logits(z, 0.7, 0.9), want, rtol=1e-5, atol=1e-6)
    assert (nucleus_entropy_from_logits(z, 0.7, 0.9) < entropy_from_logits(z, 0.7)).all()


@pytest.fixture(scope="module")
def small_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(cfg).eval()


def test_teacher_forced_entropy_equals_a_full_forward(small_model):
    prompt, completion = [3, 7, 11, 2], [5, 9, 1, 40, 33]
    got = completion_entropies(small_model, prompt, completion, chunk=2)
    with torch.no_grad():
        logits = small_model(input_ids=torch.tensor([prompt + completion])).logits[0]
    # position t predicts token t+1: the completion's tokens are predicted from len(prompt)-1 to the one before last
    want = entropy_from_logits(logits[len(prompt) - 1 : -1])
    assert got.shape == (len(completion),)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert completion_entropies(small_model, prompt, []).numel() == 0


def assert_each_alone(model, pairs, got, temperatures):
    """Each completion's batched entropies equal one forward pass over its own prompt + completion."""
    for (p, c), h in zip(pairs, got):
        assert h.shape == (len(c), len(temperatures))
        for j, t in enumerate(temperatures):
            np.testing.assert_allclose(
                h[:, j], completion_entropies(model, p, c, temperature=t).numpy(), rtol=1e-5, atol=1e-5
            )


def test_batched_entropies_equal_one_pass_per_completion_at_every_temperature(small_model):
    """Right-padded batches of different lengths (split by the token budget) give each completion's own entropies,
    at the sampling temperature and at T = 1 from the same logits."""
    pairs = [([3, 7, 11, 2], [5, 9, 1, 40, 33]), ([4], [8, 8]), ([1, 2, 3, 4, 5, 6, 7], [9]), ([6, 6], [])]
    got = batched_completion_entropies(small_model, pairs, (0.6, 1.0), max_batch_tokens=12, chunk=2)
    assert_each_alone(small_model, pairs, got, (0.6, 1.0))
    assert not np.allclose(got[0][:, 0], got[0][:, 1])  # the two temperatures really differ
    # top_p < 1: one more column, the nucleus at the sampling temperature, from the same logits
    nucleus = batched_completion_entropies(small_model, pairs, (0.6, 1.0), max_batch_tokens=12, chunk=2, top_p=0.8)
    prompt, completion = pairs[0]
    with torch.no_grad():
        logits = small_model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
    np.testing.assert_allclose(
        nucleus[0][:, 2], nucleus_entropy_from_logits(logits, 0.6, 0.8).numpy(), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(nucleus[0][:, :2], got[0], rtol=1e-6, atol=1e-6)


def test_completions_of_one_prompt_share_it_and_score_as_each_alone(small_model):
    """eval.n samples of a problem: the prompt runs once for the group (prefix.shared_prompt_hidden), mixed with
    prompts of their own; empty and one-token completions included, split across sub-batches by the budget."""
    a, b = [3, 7, 11, 2], [9, 4]
    pairs = [
        (a, [5, 9, 1, 40]),
        (b, [7]),
        (a, [5]),
        (a, []),
        (a, [12, 13, 14, 15, 16, 17]),
        (b, [2, 30]),
        ([8, 8, 8], [1, 2]),
    ]
    got = batched_completion_entropies(small_model, pairs, (0.7, 1.0), max_batch_tokens=12, chunk=3)
    assert_each_alone(small_model, pairs, got, (0.7, 1.0))


def test_summary_hand_values():
    s = summarize([np.array([1.0, 2.0]), np.array([3.0]), np.array([])])
    assert s["mean_per_token"] == pytest.approx(2.0)
    assert s["mean_per_completion"] == pytest.approx((1.5 + 3.0) / 2)
    assert (s["tokens"], s["completions"]) == (3, 2)
    assert sum(s["histogram"]["counts"]) == 3
    assert s["quantiles"]["p50"] == pytest.approx(2.0, abs=0.1)  # to within a bin
    same = summarize_stats([3.0, 3.0, 0.0], [2, 1, 0], histogram(np.array([1.0, 2.0])) + histogram(np.array([3.0])))
    assert same["mean_per_token"] == s["mean_per_token"] and same["mean_per_completion"] == s["mean_per_completion"]
    assert summarize([])["mean_per_token"] is None


def test_histogram_and_quantiles():
    h = histogram(np.array([0.05, 0.05, 20.0]))
    assert h[0] == 2 and h[-1] == 1  # beyond the last edge goes into the last bin
    counts = np.zeros(len(HIST_EDGES) - 1, dtype=np.int64)
    counts[10] = 4  # four values in [1.0, 1.1)
    assert hist_quantile(counts, HIST_EDGES, 0.5) == pytest.approx(1.05)
    assert hist_quantile(counts, HIST_EDGES, 1.0) == pytest.approx(1.1)
