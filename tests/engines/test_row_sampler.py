"""The hf engine's per-row sampler (RowSampler) draws from the distribution transformers' own sampling draws from:
softmax(logits / temperature) cut to its top_p nucleus, checked by a chi-square test over a small vocabulary."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import TemperatureLogitsWarper, TopPLogitsWarper

from es_ray.core.config import SamplingConfig
from es_ray.engines.hf import RowSampler

LOGITS = torch.tensor([2.0, 1.5, 0.3, -0.5, 0.0, 1.0])


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.8), (1.3, 0.5)])
def test_a_rows_draw_follows_transformers_temperature_and_top_p(temperature, top_p):
    rows = 10000
    sampler = RowSampler(list(range(7, 7 + rows)), SamplingConfig(temperature=temperature, top_p=top_p))
    drawn = sampler(None, LOGITS.expand(rows, -1).clone()).argmax(-1).numpy()
    want = TopPLogitsWarper(top_p)(None, TemperatureLogitsWarper(temperature)(None, LOGITS[None].clone()))
    probs = want.softmax(-1)[0].double().numpy()
    seen = np.bincount(drawn, minlength=len(probs))
    assert seen[probs == 0].sum() == 0  # nothing outside the nucleus
    keep = probs > 0
    assert chisquare(seen[keep], probs[keep] / probs[keep].sum() * seen[keep].sum()).pvalue > 1e-4


def test_a_rows_draw_depends_on_its_seed_not_on_the_batch():
    sampling = SamplingConfig(temperature=1.0, top_p=0.9)
    alone = RowSampler([5], sampling)(None, LOGITS[None].clone()).argmax(-1)
    batched = RowSampler([1, 5, 9], sampling)(None, LOGITS.expand(3, -1).clone()).argmax(-1)
    assert alone.item() == batched[1].item()
