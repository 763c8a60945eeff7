"""The GRPO learner Ray actor: the policy as a torch model (fp32 or bf16), AdamW, gradient-norm clipping, optional
gradient checkpointing, and a frozen reference model only when grpo.beta > 0. The loss is grpo.loss's.

One ``train_step`` is grpo.epochs_per_batch optimizer steps on one batch, each accumulating gradients over
micro-batches; the log-probs of the first pass (before any step) are the ratio's old policy.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from grpo.config import GRPOTrainConfig

from es_ray.runtime.checkpoint import meta_file, state_file

STATE_FILE = state_file("grpo")
"""Optimizer, scheduler, RNG state and step, beside the HF weights of a GRPO checkpoint."""
META_FILE = meta_file("grpo")


class GRPOLearner:
    def __init__(self, cfg: GRPOTrainConfig):
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        from es_ray.engines.base import resolve_device
        from es_ray.models import resolve_model
        from es_ray.core.dtypes import resolve_dtype

        hf_logging.set_verbosity_error()
        g = cfg.grpo
        torch.set_num_threads(cfg.engine.threads or max(1, int(cfg.cluster.cpus_per_actor)))
        self.cfg, self.g = cfg, g
        self.model_dir = resolve_model(cfg.model.path)
        self.device = resolve_device(cfg.engine)
        dtype = resolve_dtype(g.dtype, self.device, "grpo.dtype")
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=dtype).to(self.device)
        if g.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
            self.model.config.use_cache = False
        self.model.train()
        self.ref = None
        if g.beta > 0:
            self.ref = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=dtype).to(self.device).eval()
            self.ref.requires_grad_(False)
        pattern = re.compile(cfg.model.trainable) if cfg.model.trainable else None
        for name, p in self.model.named_parameters():
            p.requires_grad_(pattern is None or bool(pattern.search(name)))
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError(f"model.trainable={cfg.model.trainable!r} matches no parameter")
        self.optimizer = torch.optim.AdamW(self.params, lr=g.lr, betas=(g.adam_beta1, g.adam_beta2), eps=g.adam_eps,
                                           weight_decay=g.weight_decay)
        warmup = g.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / (warmup + 1)) if warmup else 1.0)
        self.pad_id = self.model.config.pad_token_id or 0

    def ready(self) -> dict:
        return {"pid": os.getpid(), "device": self.device,
                "parameters": sum(p.numel() for p in self.model.parameters()),
                "trainable": sum(p.numel() for p in self.params), "reference": self.ref is not None}

    # -- one batch -------------------------------------------------------------------------------------------
    def _pad(self, samples: list[dict]):
        """Right-padded prompt + completion ids [B, L]; targets are ids shifted by one, and the mask is 1 where the
        target is a completion token."""
        import torch

        seqs = [s["prompt_ids"] + s["completion_ids"] for s in samples]
        L = max(len(x) for x in seqs)
        ids = torch.full((len(seqs), L), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(seqs), L), dtype=torch.long)
        mask = torch.zeros((len(seqs), L - 1))
        for b, (s, x) in enumerate(zip(samples, seqs)):
            ids[b, : len(x)] = torch.tensor(x)
            attn[b, : len(x)] = 1
            mask[b, len(s["prompt_ids"]) - 1 : len(x) - 1] = 1.0
        return ids.to(self.device), attn.to(self.device), mask.to(self.device)

    def _log_probs(self, model, ids, attn, mask):
        """[B, L-1] log-probs of ids[:, 1:] (0 off the mask) and [N, V] logits of the N masked positions.

        The LM head runs on completion positions only: prompts are ~3x longer than completions here, and the head
        (vocabulary x hidden) with its log-softmax is a large share of a small model's cost."""
        import torch

        from grpo.loss import token_log_probs

        hidden = model.base_model(input_ids=ids, attention_mask=attn).last_hidden_state[:, :-1]
        sel = mask.bool()
        logits = model.get_output_embeddings()(hidden[sel])
        logp = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        logp = logp.masked_scatter(sel, token_log_probs(logits.unsqueeze(0), ids[:, 1:][sel].unsqueeze(0))[0])
        return logp, logits

    def train_step(self, samples: list[dict], advantages: list[float]) -> dict:
        import torch

        from es_ray.eval.entropy import entropy_from_logits
        from grpo.loss import grpo_loss

        g, t0 = self.g, time.perf_counter()
        mb = g.micro_batch_size
        chunks = [(samples[i : i + mb], advantages[i : i + mb]) for i in range(0, len(samples), mb)]
        padded = [self._pad(s) for s, _ in chunks]
        n_seq = len(samples)
        n_tok = float(sum(len(s["completion_ids"]) for s in samples))
        old_logp, ref_logp = [], []
        totals = {"loss": 0.0, "clipped_tokens": 0.0, "kl_sum": 0.0, "ratio_sum": 0.0, "tokens": 0.0,
                  "entropy_sum": 0.0, "grad_norm": 0.0}
        backprop_tokens = 0
        for epoch in range(g.epochs_per_batch):
            self.optimizer.zero_grad(set_to_none=True)
            for k, ((_, adv), (ids, attn, mask)) in enumerate(zip(chunks, padded)):
                logp, logits = self._log_probs(self.model, ids, attn, mask)
                if epoch == 0:
                    old_logp.append(logp.detach())  # the policy that sampled the batch: these weights
                    with torch.no_grad():
                        totals["entropy_sum"] += float(entropy_from_logits(logits).sum())
                        if self.ref is not None:
                            ref_logp.append(self._log_probs(self.ref, ids, attn, mask)[0])
                del logits
                loss, stats = grpo_loss(
                    logp, old_logp[k], torch.tensor(adv, device=self.device), mask, loss_type=g.loss_type,
                    clip_eps=g.clip_eps, clip_eps_high=g.clip_eps_high, beta=g.beta,
                    ref_logp_bt=ref_logp[k] if self.ref is not None else None,
                    max_tokens=self.cfg.sampling.max_new_tokens, num_sequences=n_seq, num_tokens=n_tok)
                loss.backward()
                backprop_tokens += int(attn.sum())
                totals["loss"] += float(loss.detach())
                for key, value in stats.items():
                    totals[key] += float(value)
            max_norm = g.max_grad_norm if g.max_grad_norm > 0 else float("inf")
            totals["grad_norm"] += float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        e, tok = g.epochs_per_batch, max(totals["tokens"], 1.0)
        return {"grpo/loss": totals["loss"] / e, "grpo/kl": totals["kl_sum"] / tok,
                "grpo/clip_frac": totals["clipped_tokens"] / tok, "grpo/ratio_mean": totals["ratio_sum"] / tok,
                "grpo/entropy": totals["entropy_sum"] / max(n_tok, 1.0), "grpo/grad_norm": totals["grad_norm"] / e,
                "grpo/lr": self.scheduler.get_last_lr()[0], "tokens_backpropagated": backprop_tokens,
                "seconds": time.perf_counter() - t0}

    # -- weights, probe, checkpoints ---------------------------------------------------------------------------
    def weights(self) -> dict:
        """The policy by HF parameter name, as fp32 CPU tensors (what the rollout engines are written with)."""
        import torch

        return {n: p.detach().to("cpu", torch.float32, copy=True) for n, p in self.model.named_parameters()}

    def probe_logprobs(self, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
        from es_ray.eval.entropy import completion_log_probs

        self.model.eval()
        try:
            return completion_log_probs(self.model, prompt_ids, completion_ids).tolist()
        finally:
            self.model.train()

    def save(self, path: str, meta: dict) -> str:
        import torch

        from es_ray.runtime.checkpoint import save_checkpoint

        state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                 "torch_rng": torch.get_rng_state(), "step": meta.get("step")}
        save_checkpoint(path, self.weights(), self.model_dir, state, meta, "grpo")
        return path

    def load(self, path: str) -> dict:
        """Weights, optimizer, scheduler and RNG from a checkpoint written by ``save``; returns its meta."""
        import json

        import torch

        from es_ray.models import load_hf_weights

        weights = load_hf_weights(path)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                src = weights.get(name)
                if src is None and name == "lm_head.weight":  # tied: saved once, as the embedding
                    src = weights["model.embed_tokens.weight"]
                p.copy_(src)
        state = torch.load(Path(path) / STATE_FILE, weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        return json.loads((Path(path) / META_FILE).read_text())

    def peak_memory(self) -> dict:
        from es_ray.runtime.ledger import process_peak_memory

        return process_peak_memory()
