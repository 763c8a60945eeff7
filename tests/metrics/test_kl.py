"""Off-task KL (es_ray/metrics/kl.py) against a brute-force sum over the vocabulary, and es-eval's eval.kl_base on
the tiny model: zero against itself, positive against a perturbed copy, refused for another vocabulary."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from es_ray.metrics.kl import completion_kl_sums, summarize_kl, token_kl
from paths import FIXTURES


def brute_distribution(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """softmax(l / T) in float64 by a plain loop, truncated to the top-p nucleus and renormalised."""
    z = logits.astype(np.float64) / temperature
    e = np.exp(z - z.max())
    p = e / e.sum()
    if top_p >= 1:
        return p
    kept, mass = np.zeros_like(p), 0.0
    for v in np.argsort(-p, kind="stable"):
        if mass >= top_p:
            break
        kept[v], mass = p[v], mass + p[v]
    return kept / kept.sum()


def brute_kl(p: np.ndarray, q: np.ndarray) -> float:
    total = 0.0
    for pv, qv in zip(p, q):
        if pv > 0:
            total += np.inf if qv == 0 else pv * (np.log(pv) - np.log(qv))
    return total


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.6, 1.0), (0.6, 0.95), (1.3, 0.5)])
def test_token_kl_equals_a_brute_force_sum_over_the_vocabulary(temperature, top_p):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 13, generator=g) * 3
    tuned = base + 0.5 * torch.randn(6, 13, generator=g)
    got = token_kl(base, tuned, temperature, top_p)
    for n in range(6):
        b, t = base[n].numpy(), tuned[n].numpy()
        p, q = brute_distribution(b, temperature, 1.0), brute_distribution(t, temperature, 1.0)
        assert float(got["base_tuned"][n]) == pytest.approx(brute_kl(p, q), rel=1e-5, abs=1e-7)
        assert float(got["tuned_base"][n]) == pytest.approx(brute_kl(q, p), rel=1e-5, abs=1e-7)
        if top_p < 1:
            pn, qn = brute_distribution(b, temperature, top_p), brute_distribution(t, temperature, top_p)
            for key, want in (("nucleus_base_tuned", brute_kl(pn, qn)), ("nucleus_tuned_base", brute_kl(qn, pn))):
                v = float(got[key][n])
                assert (np.isinf(want) and np.isinf(v)) or v == pytest.approx(want, rel=1e-5, abs=1e-7)
    if top_p == 0.5:  # two nuclei of one token each that differ: infinite, and counted apart from the rest
        base[2], tuned[2] = torch.eye(13)[0] * 9, torch.eye(13)[1] * 9
        got = token_kl(base, tuned, temperature, top_p)
        sums = completion_kl_sums(base, tuned, temperature, top_p, chunk=4)
        inf = int(torch.isinf(got["nucleus_base_tuned"]).sum())
        assert inf > 0 and sums["nucleus_base_tuned_infinite"] == inf and np.isfinite(sums["nucleus_base_tuned"])
        finite = got["nucleus_base_tuned"][torch.isfinite(got["nucleus_base_tuned"])]
        assert sums["nucleus_base_tuned"] == pytest.approx(float(finite.sum()))
    assert torch.equal(token_kl(base, base, temperature, top_p)["base_tuned"], torch.zeros(6))


def test_summary_is_the_token_weighted_mean_with_per_problem_means():
    per_sample = [
        {"tokens": 2, "base_tuned": 0.4, "tuned_base": 0.2},
        {"tokens": 3, "base_tuned": 0.3, "tuned_base": 0.9},
        {"tokens": 1, "base_tuned": 0.5, "tuned_base": 0.1},
    ]
    out = summarize_kl(per_sample, [0, 0, 1])
    assert out["base_tuned"] == pytest.approx(1.2 / 6) and out["tuned_base"] == pytest.approx(1.2 / 6)
    assert out["per_problem"]["0"]["base_tuned"] == pytest.approx(0.7 / 5)
    assert out["per_problem"]["1"]["tuned_base"] == pytest.approx(0.1) and out["tokens"] == 6


def _perturbed_copy(src: Path, dst: Path, scale: float) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    weights = {k: v + scale * torch.randn(v.shape, generator=g) for k, v in weights.items()}
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_teacher_forced_kl_on_a_model_equals_the_brute_force_sum(tiny_model_dir, tmp_path):
    """The worker's path (one forward per model with logits_to_keep, chunked KL) against a full forward of each model
    and a float64 sum over all of the vocabulary at every completion position."""
    from transformers import AutoModelForCausalLM

    from es_ray.evaluation.worker import completion_logits

    tuned_dir = _perturbed_copy(tiny_model_dir, tmp_path / "tuned", 2e-2)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    tuned = AutoModelForCausalLM.from_pretrained(tuned_dir, torch_dtype=torch.float32).eval()
    prompt, completion = [1, 17, 290, 33, 8], [400, 12, 9, 77, 3001, 5]
    with torch.no_grad():
        sums = completion_kl_sums(
            completion_logits(base, prompt, completion), completion_logits(tuned, prompt, completion), 0.7, 0.9, chunk=4
        )
        ids = torch.tensor([prompt + completion])
        lb, lt = base(input_ids=ids).logits[0].double().numpy(), tuned(input_ids=ids).logits[0].double().numpy()
    want_bt = want_tb = 0.0
    for pos in range(len(prompt) - 1, len(prompt) + len(completion) - 1):
        p, q = brute_distribution(lb[pos], 0.7, 1.0), brute_distribution(lt[pos], 0.7, 1.0)
        want_bt, want_tb = want_bt + brute_kl(p, q), want_tb + brute_kl(q, p)
    assert sums["tokens"] == len(completion)
    assert sums["base_tuned"] == pytest.approx(want_bt, rel=1e-4) and sums["tuned_base"] == pytest.approx(
        want_tb, rel=1e-4
    )
    assert want_bt > 0


def _eval(tiny_model_dir, model_dir, run_dir, **kl):
    from es_ray.evaluation.config import EvalJobConfig, validate_eval
    from es_ray.evaluation.es_eval import run

    cfg = EvalJobConfig()
    cfg.model.path = str(model_dir)
    ev = cfg.eval
    ev.tasks, ev.paths, ev.n, ev.k, ev.limit = ["gsm8k"], {"gsm8k": str(FIXTURES / "gsm8k.jsonl")}, 2, [1, 2], 2
    ev.max_new_tokens, ev.entropy, ev.kl_base, ev.kl_reference, ev.kl_samples = 6, False, True, str(tiny_model_dir), 2
    cfg.engine.dtype, cfg.engine.device, cfg.engine.batch_size = "float32", "cpu", 8
    cfg.cluster.num_actors = 0  # in this process
    cfg.run.dir, cfg.run.progress, cfg.run.trackers = str(run_dir), False, []
    return run(validate_eval(cfg))


def test_es_eval_reports_kl_zero_against_itself_and_positive_against_a_perturbed_copy(tiny_model_dir, tmp_path):
    same = _eval(tiny_model_dir, tiny_model_dir, tmp_path / "same")["tasks"]["gsm8k"]["kl"]
    assert same["base_tuned"] == 0.0 and same["tuned_base"] == 0.0 and same["samples"] == 4
    tuned = _perturbed_copy(tiny_model_dir, tmp_path / "tuned", 2e-2)
    res = _eval(tiny_model_dir, tuned, tmp_path / "tuned_run")
    kl = res["tasks"]["gsm8k"]["kl"]
    assert kl["base_tuned"] > 0 and kl["tuned_base"] > 0 and kl["tokens"] > 0
    assert sorted(kl["per_problem"]) == ["0", "1"] and "nucleus_base_tuned_infinite_share" in kl
    assert res["settings"]["kl_reference"] == str(tiny_model_dir)
    saved = json.loads((tmp_path / "tuned_run" / "results.json").read_text())
    assert saved["tasks"]["gsm8k"]["kl"]["base_tuned"] == kl["base_tuned"]


def test_kl_between_different_vocabularies_is_refused_in_one_line(tiny_model_dir, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["vocab_size"] += 7
    (other / "config.json").write_text(json.dumps(cfg))
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    res = subprocess.run(
        [
            "es-eval",
            f"model.path={tiny_model_dir}",
            "eval.kl_base=true",
            f"eval.kl_reference={other}",
            "eval.tasks=[gsm8k]",
            f"eval.data_dir={FIXTURES}",
            f"run.dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr[-2000:]
    assert "vocab_size" in res.stderr and "eval.kl_reference" in res.stderr and not (tmp_path / "run").exists()
