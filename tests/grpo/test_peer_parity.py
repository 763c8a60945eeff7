"""Parity with the peers (docs/design.md "A fair comparison"): the project's GRPO gradient is TRL's GRPOTrainer's, and
the project's ES update is the ES authors' reference update.

GRPO: the learner's own ``train_step`` (its log-prob path, micro-batches, loss) against TRL 1.16's own
``GRPOTrainer._compute_loss`` on the same tiny model, batch and advantages: the gradient of each loss aggregation
(grpo, dr_grpo, dapo), at ratio 1 (the first epoch) and at ratio != 1 with the k3 KL at beta 0.04 (the second epoch,
the old log-probs kept, the reference the initial weights). TRL's advantages divide by the Bessel std where the
project's divide by the population std (grpo/loss.py), a norm ratio of sqrt(G / (G - 1)) and no change of direction;
the project's advantages are fed to both, so the gradients are equal, not only parallel.

ES: the reference (VsonicV/es-fine-tuning-paper, countdown/es_fine-tuning_countdown.py at commit
523afc87a4efc845ae5ea9aa65c64e2e57e0643e) perturbs, restores and updates every parameter from one generator seeded
with the member's seed; its update is theta += alpha / N * sum_i z_i eps_i with z the z-scores of the member rewards
(numpy's population std, + 1e-8). The loop below is written from that file, not from the project's code."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from es_ray.grpo.config import to_grpo_config
from es_ray.grpo.learner import GRPOLearner

G, PROMPTS, MAX_TOKENS, TEMPERATURE = 4, 2, 8, 0.7
REWARDS = torch.tensor([[1.0, 0.0, 0.5, 0.0], [0.0, 1.0, 1.0, 0.25]])  # [PROMPTS, G]


def _batch():
    """PROMPTS prompts of one length (TRL left-pads prompts and the model reads no position ids from the mask) x G
    completions of 3..MAX_TOKENS tokens, and group-relative advantages from fixed rewards."""
    from es_ray.grpo.loss import group_advantages

    g = torch.Generator().manual_seed(3)
    samples = []
    for p in range(PROMPTS):
        prompt = torch.randint(10, 1000, (6,), generator=g).tolist()
        for i in range(G):
            n = 3 + (5 * p + 3 * i) % (MAX_TOKENS - 2)
            completion = torch.randint(10, 1000, (n,), generator=g).tolist()
            samples.append({"prompt_ids": prompt, "completion_ids": completion})
    return samples, group_advantages(REWARDS).flatten().tolist()


def _learner_gradients(model_dir, loss_type, beta, epochs):
    """The gradient the learner's train_step hands its optimizer at each epoch, and its weights after epoch 1."""
    lrn = GRPOLearner(
        to_grpo_config(
            {
                "model": {"path": str(model_dir)},
                "engine": {"threads": 1},
                "sampling": {"temperature": TEMPERATURE, "max_new_tokens": MAX_TOKENS},
                "grpo": {
                    "lr": 1e-3,
                    "micro_batch_size": G,
                    "loss_type": loss_type,
                    "beta": beta,
                    "max_grad_norm": 0.0,
                    "epochs_per_batch": epochs,
                    "clip_eps": 0.2,
                    "clip_eps_high": 0.28,
                    "group_size": G,
                    "prompts_per_step": PROMPTS,
                },
            }
        )
    )
    grads, after = [], []
    real_step = lrn._optimizer_step

    def step():
        grads.append({n: p.grad.detach().clone() for n, p in lrn.named.items() if p.grad is not None})
        real_step()
        after.append({n: p.detach().clone() for n, p in lrn.named.items()})

    lrn._optimizer_step = step
    lrn.train_step(*_batch())
    return grads, after


def _trl_gradient(trainer, inputs):
    trainer.model.zero_grad(set_to_none=True)
    trainer.model.train()
    trainer._compute_loss(trainer.model, inputs).backward()
    return {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


def _compare(ours, theirs):
    """Cosine and norm ratio (ours / theirs) of the whole flattened gradient, over the parameters both hold."""
    names = sorted(set(ours) & set(theirs))
    assert len(names) >= 10, names
    a = torch.cat([ours[n].flatten().double() for n in names])
    b = torch.cat([theirs[n].flatten().double() for n in names])
    return float(a @ b / (a.norm() * b.norm())), float(a.norm() / b.norm())


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_grpo_gradient_equals_trl_grpotrainer_loss_gradient(tiny_model_dir, loss_type):
    pytest.importorskip("trl", reason="trl (the test extra) is not installed: pip install -e '.[test]'")
    from es_ray.grpo.peer import trl_inputs, trl_log_probs, trl_trainer

    beta = 0.04
    grads, after = _learner_gradients(tiny_model_dir, loss_type, beta, epochs=2)
    trainer = trl_trainer(
        str(tiny_model_dir),
        group_size=G,
        max_tokens=MAX_TOKENS,
        temperature=TEMPERATURE,
        beta=beta,
        loss_type=loss_type,
        clip_eps=0.2,
        clip_eps_high=0.28,
    )
    samples, adv = _batch()
    inputs = trl_inputs(samples, adv, trainer.processing_class.pad_token_id)
    old = trl_log_probs(trainer, trainer.model, inputs)  # the initial weights: the policy that "sampled" the batch
    inputs["ref_per_token_logps"] = trl_log_probs(trainer, trainer.ref_model, inputs)

    # epoch 1: ratio 1 and KL 0 at the initial weights
    cos, ratio = _compare(grads[0], _trl_gradient(trainer, inputs))
    assert cos == pytest.approx(1.0, abs=1e-6) and ratio == pytest.approx(1.0, abs=1e-5), (cos, ratio)

    # epoch 2: the learner's weights after its first step, the old log-probs of the initial weights (ratio != 1),
    # the KL to the initial weights (> 0)
    with torch.no_grad():
        for n, w in after[0].items():
            trainer.model.get_parameter(n).copy_(w)
    moved = trl_log_probs(trainer, trainer.model, inputs)
    mask = inputs["completion_mask"].bool()
    assert (moved - old)[mask].abs().max() > 1e-3  # the ratio is away from 1 and the KL away from 0
    cos, ratio = _compare(grads[1], _trl_gradient(trainer, {**inputs, "old_per_token_logps": old}))
    assert cos == pytest.approx(1.0, abs=1e-6) and ratio == pytest.approx(1.0, abs=1e-5), (cos, ratio)


def test_trl_bessel_std_scales_the_gradient_by_sqrt_g_over_g_minus_1(tiny_model_dir):
    """TRL divides by its ``nanstd`` (Bessel, G - 1) + 1e-4 (grpo_trainer.py's advantage step), the project by the
    population std (G) + 1e-6, as the ES authors' own GRPO baseline does (np.std): the same direction, the
    project's norm larger by sqrt(G / (G - 1)) to within the two epsilons."""
    pytest.importorskip("trl", reason="trl (the test extra) is not installed: pip install -e '.[test]'")
    from trl.trainer.utils import nanstd

    from es_ray.grpo.peer import trl_inputs, trl_trainer

    grads, _ = _learner_gradients(tiny_model_dir, "grpo", 0.0, epochs=1)
    trainer = trl_trainer(str(tiny_model_dir), group_size=G, max_tokens=MAX_TOKENS, temperature=TEMPERATURE)
    samples, _ = _batch()
    centred = REWARDS - REWARDS.mean(dim=1, keepdim=True)
    trl_adv = (centred / (nanstd(REWARDS, dim=1).unsqueeze(1) + 1e-4)).flatten().tolist()
    pad = trainer.processing_class.pad_token_id
    cos, ratio = _compare(grads[0], _trl_gradient(trainer, trl_inputs(samples, trl_adv, pad)))
    assert cos == pytest.approx(1.0, abs=1e-6)
    assert ratio == pytest.approx((G / (G - 1)) ** 0.5, rel=1e-3), ratio


# -- ES: the reference's update and its members' rewards -----------------------------------------------------------


def _reference_perturb(model, seed: int, scale: float) -> None:
    """The reference's process_seed perturbation (and, with -sigma, its restore), as it reads at that commit:
    for every named parameter a generator seeded with the member's seed draws randn(param.shape) in the
    parameter's dtype, and the weights move by scale * noise in place."""
    for _, param in model.named_parameters():
        gen = torch.Generator(device=param.device)
        gen.manual_seed(int(seed))
        noise = torch.randn(param.shape, generator=gen, device=param.device, dtype=param.dtype)
        param.data.add_(scale * noise)


def _reference_update(model, seeds: list[int], rewards: list[float], alpha: float) -> None:
    """The reference's update: z-scores of the rewards (numpy's population std + 1e-8), then per parameter
    update = sum_i z_i * randn(seed_i) / N and theta += alpha * update."""
    r = np.array(rewards, dtype=np.float32)
    z = (r - r.mean()) / (r.std() + 1e-8)
    for _, param in model.named_parameters():
        gen = torch.Generator(device=param.device)
        update = torch.zeros_like(param)
        for seed_idx, seed in enumerate(seeds):
            gen.manual_seed(int(seed))
            noise = torch.randn(param.shape, generator=gen, device=param.device, dtype=param.dtype)
            noise.mul_(float(z[seed_idx]))
            update.add_(noise)
        update.div_(len(seeds))
        param.data.add_(alpha * update)


def _reference_rewards(model, tok, prompts, problems, task, max_new_tokens) -> float:
    """The reference's evaluate_model for one member: the batch left-padded, greedy model.generate, each
    completion decoded and scored, the mean reward. The completion is cut at the first end-of-sequence token,
    as the reference's decode(skip_special_tokens=True) drops what follows it as padding."""
    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    with torch.inference_mode():
        out = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
            temperature=None,
            top_p=None,
            top_k=None,
        )
    texts = [tok.decode(row, skip_special_tokens=True) for row in out[:, enc["input_ids"].shape[1] :]]
    return float(np.mean([task.reward(t, p) for t, p in zip(texts, problems)]))


def _parity_worker(model_dir, run_dir, noise="per_tensor"):
    from helpers import tiny_cfg

    from es_ray.es.worker import ESWorker

    cfg = tiny_cfg(model_dir, run_dir, es__noise=noise, es__noise_scope="reference", es__sigma=0.05, es__lr=0.05 * 0.05)
    return cfg, ESWorker(cfg)


@pytest.mark.parametrize("noise", ["per_tensor", "auto"])
def test_es_parity_mode_members_and_update_equal_the_reference_loop(tiny_model_dir, tmp_path, noise):
    """es.noise_scope=reference (with es.noise=per_tensor, or the default auto, which picks per_tensor under this
    scope on a CPU too): each member's reward from the project's actor equals the reward the reference's
    perturb -> generate -> score loop gets from the member's seed, and the update the actor applies equals the
    reference's update (alpha = lr / sigma) to float32 rounding."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from es_ray.es.protocol import EvalRequest, UpdateRequest
    from es_ray.noise import derive_seed
    from es_ray.strategy import ask, zscore

    cfg, worker = _parity_worker(tiny_model_dir, tmp_path, noise)
    es = cfg.es
    members = tuple(ask(es.population))
    prompt_ids = tuple(range(es.prompts_per_iteration))
    got = worker.evaluate(EvalRequest(0, es.sigma, members, prompt_ids, sample_seed=0)).members
    ours = [m.reward for m in sorted(got, key=lambda m: m.index)]
    seeds = [derive_seed(cfg.run.seed, 0, m.noise_id, "") for m in members]  # the member's one seed, all tensors

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    prompts = [worker._prompts["train"][i] for i in prompt_ids]
    problems = [worker.task.train[i] for i in prompt_ids]
    theirs = []
    for seed in seeds:
        _reference_perturb(model, seed, es.sigma)
        theirs.append(_reference_rewards(model, tok, prompts, problems, worker.task, cfg.sampling.max_new_tokens))
        _reference_perturb(model, seed, -es.sigma)
    assert len(set(ours)) > 1, ours  # the members differ, so equal lists say something
    assert ours == pytest.approx(theirs, abs=1e-12), (ours, theirs)

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)  # no restore drift
    _reference_update(model, seeds, theirs, alpha=es.lr / es.sigma)
    worker.update(UpdateRequest(0, es.sigma, members, tuple(zscore(np.array(ours)).tolist()), want_checksum=False))
    master = worker.replica.replica.master
    assert set(master) == set(before), (sorted(master), sorted(before))
    num = den = 0.0
    for name, p in model.named_parameters():
        ref_delta = p.detach().double() - before[name].double()
        our_delta = master[name].double() - before[name].double()
        num += float((our_delta - ref_delta).pow(2).sum())
        den += float(ref_delta.pow(2).sum())
    assert den > 0 and (num / den) ** 0.5 < 1e-5, (num / den) ** 0.5


@pytest.mark.parametrize("noise", ["table", "counter"])
def test_es_parity_mode_refuses_a_noise_the_reference_does_not_draw(tiny_model_dir, tmp_path, noise):
    from es_ray.core.config import ConfigError

    with pytest.raises(ConfigError, match=r"^es.noise_scope=reference needs es.noise=per_tensor") as err:
        _parity_worker(tiny_model_dir, tmp_path, noise)
    assert "\n" not in str(err.value) and f"es.noise={noise}" in str(err.value)


def test_reference_noise_on_a_cpu_depends_on_the_element_count_only():
    """What docs/es-update.md says of the reference's sharing (one seed for every tensor of a member): on a CPU a
    tensor's noise depends on its element count alone, so every equal-sized tensor of every layer gets the same
    noise, and a tensor of n >= 16 elements gets the first n - 16 values of any larger tensor's (all n when 16
    divides n, as for SmolLM2-135M's 576-wide norm weights against its matrices)."""

    def draw(shape):
        return torch.randn(shape, generator=torch.Generator().manual_seed(1234))

    matrix = draw((576, 1536)).flatten()
    assert torch.equal(draw((64, 576)).flatten(), draw((576, 64)).flatten())  # the shape does not matter
    assert torch.equal(draw((576,)), matrix[:576])  # a 576-wide norm weight: a prefix of every matrix
    odd = draw((100,))
    assert torch.equal(odd[:84], matrix[:84]) and not torch.equal(odd[84:], matrix[84:100])
