"""TRL's GRPOTrainer as the peer the project's GRPO is checked and timed against (tests/grpo/test_peer_parity.py,
benchmarks/grpo_step.py; docs/grpo.md "Parity and cost beside TRL"). Nothing here trains: it builds a trainer over a
model directory and hands its own loss (``GRPOTrainer._compute_loss``) the learner's batch in TRL's layout.

trl is in the ``test`` extra, not a runtime dependency: it is imported inside these functions only.
"""

from __future__ import annotations

import tempfile
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the annotation only: peer.py imports nothing of the run at its top
    from es_ray.grpo.rollout import Sample


def trl_trainer(
    model_dir: str,
    *,
    group_size: int,
    max_tokens: int,
    temperature: float = 1.0,
    beta: float = 0.0,
    loss_type: str = "grpo",
    clip_eps: float = 0.2,
    clip_eps_high: float = 0.0,
    lr: float = 1e-5,
    max_grad_norm: float = 1.0,
    weight_decay: float = 0.0,
):
    """A GRPOTrainer on CPU over ``model_dir`` (fp32), configured as the project's learner is: the same clip range,
    loss aggregation (TRL's ``loss_type`` names match grpo.loss_type), KL weight and form (plain k3), temperature,
    AdamW and clip. Its reward function and data set are placeholders: the loss reads only the batch it is handed."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-peer-"),
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        per_device_train_batch_size=group_size,
        num_generations=group_size,
        max_completion_length=max_tokens,
        temperature=temperature,
        beta=beta,
        loss_type=loss_type,
        epsilon=clip_eps,
        epsilon_high=clip_eps_high or clip_eps,
        learning_rate=lr,
        max_grad_norm=max_grad_norm,
        weight_decay=weight_decay,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        lr_scheduler_type="constant",
        bf16=False,
        fp16=False,
        # TRL 1.16 multiplies the k3 KL by the ratio by default (DeepSeek-V3.2's unbiased KL gradient);
        # the project's KL is GRPO's own k3 (grpo/loss.py), TRL's with this off
        use_bias_correction_kl=False,
    )
    data = Dataset.from_dict({"prompt": ["placeholder"] * group_size})
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=args,
        train_dataset=data,
        processing_class=tok,
    )
    trainer.current_gradient_accumulation_steps = 1  # what Trainer's loop sets per step: one micro-batch per step
    return trainer


def trl_inputs(samples: list[Sample], advantages: list[float], pad_id: int) -> dict:
    """The learner's batch (``prompt_ids`` / ``completion_ids`` lists) in the layout ``_compute_loss`` reads: prompts
    left-padded, completions right-padded, their masks, the advantages [B], and the token count that TRL's dapo
    divides by (``num_items_in_batch``)."""
    import torch

    P = max(len(s["prompt_ids"]) for s in samples)
    C = max(len(s["completion_ids"]) for s in samples)
    B = len(samples)
    prompt_ids = torch.full((B, P), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((B, P), dtype=torch.long)
    completion_ids = torch.full((B, C), pad_id, dtype=torch.long)
    completion_mask = torch.zeros((B, C), dtype=torch.long)
    for b, s in enumerate(samples):
        p, c = s["prompt_ids"], s["completion_ids"]
        prompt_ids[b, P - len(p) :] = torch.tensor(p)
        prompt_mask[b, P - len(p) :] = 1
        completion_ids[b, : len(c)] = torch.tensor(c)
        completion_mask[b, : len(c)] = 1
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor(advantages, dtype=torch.float32),
        "num_items_in_batch": completion_mask.sum().float(),
    }


def trl_log_probs(trainer, model, inputs: dict):
    """[B, C] per-token log-probs of the completions under ``model`` (TRL's own scorer, at its temperature)."""
    import torch

    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    with torch.no_grad():
        logp, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, attn, inputs["completion_ids"].size(1))
    return logp


def trl_step(trainer, inputs: dict):
    """TRL's loss + backward + grad-norm clip + optimizer step on ``inputs``, the whole batch as one micro-batch
    (TRL's ``training_step`` minus its accelerator bookkeeping). Returns the loss."""
    import torch

    model = trainer.model
    if trainer.optimizer is None:
        trainer.create_optimizer()
    model.train()
    loss = trainer._compute_loss(model, inputs)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), trainer.args.max_grad_norm)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())
