"""The GRPO learner Ray actor: the policy as a torch model with fp32 master weights (computing in fp32, or in bf16
under autocast with grpo.dtype=bf16_mixed), fp32 AdamW, gradient-norm clipping, optional gradient checkpointing,
and a frozen reference model only when grpo.beta > 0. The loss is grpo.loss's.

One ``train_step`` is grpo.epochs_per_batch optimizer steps on one batch, each accumulating gradients over
micro-batches; the log-probs of the first pass (before any step) are the ratio's old policy. Every log-prob,
ratio, KL and entropy is of softmax(logits / sampling.temperature), the distribution the rollouts sampled, and
the LM head runs grpo.logit_chunk_tokens positions at a time (es_ray.metrics.entropy.chunked_token_scores).

Weights leave the learner in the rollout engines' dtype, one chunk at a time (``weight_chunk``): a transformer
layer, or one tensor outside the layers.

What a rank allocates is stated beside it, without torch, in grpo/learner_memory.py (the memory plan's learner
lines; tests/engines/test_memory_plan_parts.py checks them against a learner built on the CPU).
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import socket
import time
from pathlib import Path

from es_ray.core.config import ConfigError
from es_ray.core.dtypes import resolve_dtype
from es_ray.core.manifest import CheckpointError
from es_ray.grpo.config import GRPOTrainConfig
from es_ray.grpo.rollout import Sample
from es_ray.grpo import shards
from es_ray.grpo.shards import load_moments, save_moments
from es_ray.memory_plan import startup_check
from es_ray.models import read_tensor, resolve_model, safetensors_index
from es_ray.runtime.actors import Actor, Tensors, actor_threads, once
from es_ray.runtime.checkpoint import (
    load_state,
    meta_file,
    read_meta,
    save_checkpoint,
    staging_dir,
    state_file,
    verify_dir,
)
from es_ray.runtime.process_group import own_group

# torch, transformers, accelerate, ray and the torch-backed es_ray modules (engines.base, metrics.*, grpo.loss) are
# imported inside the methods that use them: the GRPO driver imports this module to name the actor's methods and
# must start without torch (tests/repo/test_layers.py).

STATE_FILE = state_file("grpo")
"""Optimizer, scheduler, RNG state and step, beside the HF weights of a GRPO checkpoint."""
META_FILE = meta_file("grpo")
LAYER = re.compile(r"\.layers\.(\d+)\.")


def forwarded_tokens(samples: list[Sample], shared: bool) -> int:
    """Tokens one forward (and backward) pass over ``samples`` processes: every prompt + completion, or with shared
    prompts each distinct prompt once plus every completion but its last token (which predicts nothing)."""
    if not shared:
        return sum(len(s["prompt_ids"]) + len(s["completion_ids"]) for s in samples)
    prompts = {tuple(s["prompt_ids"]) for s in samples}
    return sum(map(len, prompts)) + sum(max(0, len(s["completion_ids"]) - 1) for s in samples)


def tied_key(name: str, index, tied: bool) -> str:
    """The checkpoint key a parameter is read from: its own name, or the embedding's for the LM head of a model that
    ties them (saved once, as the embedding). Any other missing name stays missing, so the caller refuses it: falling
    back to the embedding for every absent tensor read the embedding's rows into a same-shaped shard (q_proj, o_proj
    at grpo.fsdp_size>1) without a word."""
    if name in index or not (tied and name == "lm_head.weight"):
        return name
    return "model.embed_tokens.weight"


class GRPOLearner(Actor):
    """One learner rank. With grpo.fsdp_size=1 (and grpo.offload other than all) the whole learner, built at once.
    Otherwise rank ``rank`` of ``world``: the driver asks rank 0 for a rendezvous ``address()``, then every rank
    ``join``s the torch.distributed group (gloo on CPU, NCCL on GPU; no torchrun) and builds the model sharded with
    FSDP2 (``fully_shard`` per decoder layer, then at the root). Every method of a sharded learner is a collective:
    the driver calls it on all ranks at once (``ActorGroup.each``) and reads rank 0's answer."""

    def __init__(self, cfg: GRPOTrainConfig, rank: int = 0, world: int = 1):
        from transformers.utils import logging as hf_logging

        from es_ray.engines.base import resolve_device

        hf_logging.set_verbosity_error()
        g = cfg.grpo
        super().__init__(rank, actor_threads(cfg.engine, cfg.cluster))
        self.cfg, self.g, self.world = cfg, g, world
        self.sharded = world > 1 or g.offload == "all"
        self.model_dir = resolve_model(cfg.model.path)
        self.device = resolve_device(cfg.engine)
        self.mixed = g.dtype == "bf16_mixed"
        self.temperature = cfg.sampling.temperature
        self.scorer = None
        self.built = False
        if not self.sharded:
            self._build()

    def address(self) -> str:
        """Rank 0: this node's address and a free port for the process group's rendezvous (tcp://host:port)."""

        import ray

        host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        with socket.socket() as sock:
            sock.bind(("", 0))
            return f"tcp://{host}:{sock.getsockname()[1]}"

    def join(self, address: str) -> dict:
        """Join the learner's process group at ``address`` (rank 0's) and build the sharded model. The group is the
        learner's own (es_ray.runtime.process_group), never torch's default one, which a colocated vLLM owns."""

        self.group = own_group(
            address,
            self.rank,
            self.world,
            self.device,
            max(60.0, self.cfg.faults.actor_timeout_s),
            name=f"grpo-learner-{address}",
        )
        self._build()
        return self.ready()

    def close(self) -> None:
        """Leave the learner's process group (a sharded learner; nothing to do for one process)."""
        group = self.__dict__.pop("group", None)
        if group is not None:
            group.close()

    def _build(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        g = self.g
        if str(self.device).startswith("cuda"):  # this rank's own card, before the model is loaded onto it
            dev = torch.device(self.device)
            startup_check(
                "grpo",
                self.cfg,
                gpu=True,
                reported=torch.cuda.get_device_properties(dev).total_memory,
                device_name=torch.cuda.get_device_name(dev),
            )
        if self.sharded:  # no rank holds the whole fp32 model: built empty, sharded, then each rank reads its shard
            self.model = _empty_model(self.model_dir)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).to(self.device)
        if g.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False} if self.sharded else None
            )
            self.model.config.use_cache = False
        self.model.train()
        self.ref = None
        if g.beta > 0:  # frozen: no optimizer, so with bf16 compute its weights can be bf16 too (half the bytes)
            ref_dtype = torch.bfloat16 if self.mixed else torch.float32
            self.ref = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=ref_dtype).to(self.device).eval()
            self.ref.requires_grad_(False)
        pattern = re.compile(self.cfg.model.trainable) if self.cfg.model.trainable else None
        for name, p in self.model.named_parameters():
            p.requires_grad_(pattern is None or bool(pattern.search(name)))
        if self.sharded:
            self._shard()
            self._load_shards()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError(f"model.trainable={self.cfg.model.trainable!r} matches no parameter")
        # fused on CUDA: one kernel per tensor group, without the multi-tensor path's model-sized temporaries
        cuda = str(self.device).startswith("cuda") and not self.sharded
        self.host_params = None
        if g.offload == "optimizer":  # AdamW's moments and its step on the host, over fp32 host copies
            self.host_params = [
                shards.local(p).detach().to("cpu", torch.float32, copy=True).requires_grad_(True) for p in self.params
            ]
            cuda = False
        self.optimizer = torch.optim.AdamW(
            self.host_params or self.params,
            lr=g.lr,
            betas=(g.adam_beta1, g.adam_beta2),
            eps=g.adam_eps,
            weight_decay=g.weight_decay,
            fused=cuda or None,
            foreach=False,
        )
        warmup = g.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / (warmup + 1)) if warmup else 1.0
        )
        self.pad_id = self.model.config.pad_token_id or 0
        self.named = dict(self.model.named_parameters())  # a tied LM head appears once, as the embedding
        layer = lambda name: m.group(1) if (m := LAYER.search(name)) else name  # noqa: E731
        self.chunks = [list(names) for _, names in itertools.groupby(self.named, layer)]
        """Names per sync chunk: one chunk per transformer layer, one per tensor outside the layers."""
        self.built = True

    def _shard(self) -> None:
        """FSDP2: each decoder layer its own group, then the root (embedding, final norm, LM head) through a scorer
        module whose forward is the whole scoring pass, so the root's parameters are gathered for the LM head too.
        bf16_mixed: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) over the fp32 sharded master (instead
        of autocast); grpo.offload=all: CPUOffloadPolicy."""
        import torch
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        kw: dict = {}
        if self.mixed:
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if self.g.offload == "all":
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=str(self.device).startswith("cuda"))  # pinned: GPU
        layers = getattr(self.model.base_model, "layers", None)
        if layers is None:
            raise ConfigError(
                f"grpo.fsdp_size={self.g.fsdp_size}: {type(self.model).__name__} has no decoder layers "
                "at model.layers to shard; set grpo.fsdp_size=1 and grpo.offload=none"
            )
        kw["mesh"] = self.group.mesh  # the learner's own group (``join``), not one over the default group
        for block in layers:
            fully_shard(block, **kw)
        self.scorer = _scorer(self)
        fully_shard(self.scorer, **kw)

    def _load_shards(self) -> None:
        """Storage for this rank's shards only (the model was built on the meta device), filled from the model's
        files: each tensor's rows of this rank read alone (``_read_rows``), so the build's transient is one tensor's
        shard, not the model (es_ray.memory_plan's "build transient")."""
        buffers = [
            (m, k, b.detach().clone()) for m in self.model.modules() for k, b in m._buffers.items() if b is not None
        ]  # real: built off the meta device
        # grpo.offload=all keeps the shards on the host (CPUOffloadPolicy); else on the rank's device
        self.model.to_empty(device="cpu" if self.g.offload == "all" else self.device)
        for module, key, b in buffers:  # on the rank's device, where the forward runs, offloaded or not
            module._buffers[key] = b.to(self.device)
        self._read_rows(self.model_dir)

    def _read_rows(self, directory: str | Path) -> None:
        """Every parameter's rows this rank holds (a sharded learner's shard, else the whole tensor), each read alone
        from ``directory``'s safetensors files (safetensors ``get_slice``): the model's at the build, a checkpoint's
        at a resume, so neither holds more of the model on the host than one tensor's rows (es_ray.memory_plan's
        "build" and "resume" lines)."""
        import torch

        index = safetensors_index(directory)
        tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                key = tied_key(name, index, tied)
                if key not in index:
                    raise CheckpointError(
                        f"{directory}: no tensor {name!r}; move it aside to resume from an earlier checkpoint"
                    )
                local = shards.local(p)
                if local.numel() == 0:  # FSDP2's last ranks may hold no rows of a short tensor
                    continue
                rows = None
                if hasattr(p, "device_mesh"):
                    start = shards.shard_start(p)
                    rows = (slice(start, start + local.shape[0]),)
                local.copy_(read_tensor(index[key][0], key, rows).to(local.dtype))

    def ready(self) -> dict:
        if not self.built:  # a sharded rank before ``join``
            return {"pid": os.getpid(), "device": self.device, "rank": self.rank, "built": False}
        return {
            "pid": os.getpid(),
            "device": self.device,
            "rank": self.rank,
            "built": True,
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "trainable": sum(p.numel() for p in self.params),
            "reference": self.ref is not None,
            "weight_chunks": len(self.chunks),
        }

    # -- one batch -------------------------------------------------------------------------------------------
    def _pad(self, samples: list[Sample]):
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

    def _shares_prompts(self, samples: list[Sample]) -> bool:
        """A micro-batch holding several completions of one prompt (a group) runs that prompt once, except under
        gradient checkpointing (which turns the model's key/value cache off)."""
        from es_ray.metrics.prefix import shares_prompts

        return not self.g.gradient_checkpointing and shares_prompts([tuple(s["prompt_ids"]) for s in samples])

    def _completion_hidden(self, model, samples: list[Sample]):
        """[N, H]: the hidden states that predict the N completion tokens, row by row, each prompt run once for its
        rows in this micro-batch (``prefix.shared_prompt_hidden``); the same order as hidden[mask] of the padded
        forward, and the same values to within rounding (tests/grpo/test_grpo_learner.py)."""
        import torch

        from es_ray.metrics.prefix import prompt_groups, shared_prompt_hidden

        rows: dict[int, torch.Tensor] = {}
        for group in prompt_groups([tuple(s["prompt_ids"]) for s in samples]):
            comps = [samples[i]["completion_ids"] for i in group]
            hidden = shared_prompt_hidden(model.base_model, samples[group[0]]["prompt_ids"], comps, self.pad_id)
            for j, (i, c) in enumerate(zip(group, comps)):
                rows[i] = hidden[j, : len(c)]
        return torch.cat([rows[i] for i in range(len(samples))])

    def _log_probs(self, model, ids, attn, mask, entropy: bool = False, samples: list[Sample] | None = None):
        """[B, L-1] log-probs of ids[:, 1:] under softmax(logits / sampling.temperature) (0 off the mask), and the
        [N] entropies of the N masked positions when asked (else None).

        The LM head runs on completion positions only (prompts are ~3x longer than completions here, and the head
        with its log-softmax is a large share of a small model's cost), grpo.logit_chunk_tokens at a time. With
        ``samples`` whose prompts repeat (``_shares_prompts``), each prompt runs once for its rows."""
        import torch

        if self.scorer is not None and model is self.model:  # FSDP2: through the root, whose hooks gather
            logp_n, entropy_n = self.scorer(ids, attn, mask, entropy, samples)
        else:
            with torch.autocast(
                torch.device(self.device).type, dtype=torch.bfloat16, enabled=self.mixed, cache_enabled=False
            ):  # no cache: it would hold a bf16 copy of every weight at once
                logp_n, entropy_n = self._score(model, ids, attn, mask, entropy, samples)
        logp = torch.zeros(
            mask.shape, dtype=torch.float32 if logp_n.dtype == torch.bfloat16 else logp_n.dtype, device=mask.device
        )  # fp32 (fp64 in tests)
        return logp.masked_scatter(mask.bool(), logp_n.to(logp.dtype)), entropy_n

    def _score(self, model, ids, attn, mask, entropy: bool, samples: list[Sample] | None):
        """[N] log-probs (and entropies) of the N masked positions: the body of ``_log_probs``."""
        from es_ray.metrics.entropy import chunked_token_scores

        sel = mask.bool()
        if samples is not None and self._shares_prompts(samples):
            hidden_n = self._completion_hidden(model, samples)
        else:
            hidden_n = model.base_model(input_ids=ids, attention_mask=attn).last_hidden_state[:, :-1][sel]
        return chunked_token_scores(
            model.get_output_embeddings(),
            hidden_n,
            ids[:, 1:][sel],
            self.temperature,
            self.g.logit_chunk_tokens,
            entropy,
        )

    @once  # an optimizer step: never re-sent after a transient ActorUnavailableError (it may have run)
    def train_step(self, samples: list[Sample], advantages: list[float]) -> dict:
        import torch

        from es_ray.grpo.loss import grpo_loss

        g, t0 = self.g, time.perf_counter()
        mb = g.micro_batch_size
        chunks = [self._share(samples[i : i + mb], advantages[i : i + mb]) for i in range(0, len(samples), mb)]
        padded = [self._pad(s) for s, _ in chunks]
        n_seq = len(samples)
        n_tok = float(sum(len(s["completion_ids"]) for s in samples))
        old_logp, ref_logp = [], []
        totals = {
            "loss": 0.0,
            "clipped_tokens": 0.0,
            "kl_sum": 0.0,
            "ratio_sum": 0.0,
            "tokens": 0.0,
            "entropy_sum": 0.0,
            "grad_norm": 0.0,
        }
        backprop_tokens = 0
        for epoch in range(g.epochs_per_batch):
            self.optimizer.zero_grad(set_to_none=True)
            for k, ((part, adv), (ids, attn, mask)) in enumerate(zip(chunks, padded)):
                logp, entropy_n = self._log_probs(self.model, ids, attn, mask, entropy=epoch == 0, samples=part)
                if epoch == 0:
                    old_logp.append(logp.detach())  # the policy that sampled the batch: these weights
                    totals["entropy_sum"] += float(entropy_n.sum())
                    if self.ref is not None:
                        with torch.no_grad():
                            ref_logp.append(self._log_probs(self.ref, ids, attn, mask, samples=part)[0])
                loss, stats = grpo_loss(
                    logp,
                    old_logp[k],
                    torch.tensor(adv, device=self.device),
                    mask,
                    loss_type=g.loss_type,
                    clip_eps=g.clip_eps,
                    clip_eps_high=g.clip_eps_high,
                    beta=g.beta,
                    ref_logp_bt=ref_logp[k] if self.ref is not None else None,
                    max_tokens=self.cfg.sampling.max_new_tokens,
                    num_sequences=n_seq,
                    num_tokens=n_tok,
                )
                # each rank's loss is its part of the global batch's (N and M are the whole batch's); FSDP2 averages
                # the gradients over the ranks, so x world makes them the sum of the parts
                (loss * self.world if self.world > 1 else loss).backward()
                backprop_tokens += forwarded_tokens(part, self._shares_prompts(part))
                totals["loss"] += float(loss.detach())
                for key, value in stats.items():
                    totals[key] += float(value)
            max_norm = g.max_grad_norm if g.max_grad_norm > 0 else float("inf")
            totals["grad_norm"] += float(shards.full(torch.nn.utils.clip_grad_norm_(self.params, max_norm)))
            self._optimizer_step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.params:
            p.grad = None
        if self.world > 1:  # the statistics of every rank's share
            import torch.distributed as dist

            keys = [k for k in totals if k != "grad_norm"]
            # on the rank's device: NCCL serves no host tensor (tests/grpo/test_grpo_strict_collectives.py)
            summed = torch.tensor(
                [totals[k] for k in keys] + [float(backprop_tokens)], dtype=torch.float64, device=self.device
            )
            dist.all_reduce(summed, group=self.group.pg)
            totals.update(zip(keys, summed.tolist()))
            backprop_tokens = int(summed[-1])
        e, tok = g.epochs_per_batch, max(totals["tokens"], 1.0)
        return {
            "grpo/loss": totals["loss"] / e,
            "grpo/kl": totals["kl_sum"] / tok,
            "grpo/clip_frac": totals["clipped_tokens"] / tok,
            "grpo/ratio_mean": totals["ratio_sum"] / tok,
            "grpo/entropy": totals["entropy_sum"] / max(n_tok, 1.0),
            "grpo/grad_norm": totals["grad_norm"] / e,
            "grpo/lr": self.scheduler.get_last_lr()[0],
            "tokens_backpropagated": backprop_tokens,
            "seconds": time.perf_counter() - t0,
        }

    def _share(self, part: list[Sample], adv: list[float]) -> tuple[list[Sample], list[float]]:
        """This rank's contiguous 1/world of a micro-batch (grpo.fsdp_size divides grpo.micro_batch_size and the
        batch, so every rank's share of every micro-batch is equal and no rank skips a collective)."""
        if self.world == 1:
            return part, adv
        k = len(part) // self.world
        return part[self.rank * k : (self.rank + 1) * k], adv[self.rank * k : (self.rank + 1) * k]

    def _optimizer_step(self) -> None:
        """AdamW on the device's parameters, or with grpo.offload=optimizer on their fp32 host copies (the device's
        gradients copied over, the stepped weights copied back)."""
        import torch

        if self.host_params is None:
            self.optimizer.step()
            return
        for hp, p in zip(self.host_params, self.params):
            hp.grad = None if p.grad is None else shards.local(p.grad).detach().to("cpu", torch.float32)
        self.optimizer.step()
        with torch.no_grad():
            for hp, p in zip(self.host_params, self.params):
                shards.local(p).copy_(hp)
                hp.grad = None

    # -- weights, probe, checkpoints ---------------------------------------------------------------------------
    def weights(self) -> dict:
        """The policy by HF parameter name, as fp32 CPU tensors (checkpoints)."""
        import torch

        return {n: shards.full(p.detach()).to("cpu", torch.float32, copy=True) for n, p in self.named.items()}

    def weight_chunk(self, k: int, dtype: str, everywhere: bool = False, on_device: bool = False) -> dict:
        """Chunk ``k`` of the weights (a transformer layer, or one other tensor) by HF name, cast to ``dtype`` (the
        rollout engine's) on the learner's device, then copied to the CPU: the sync sends the engine's bytes (as
        ``Tensors``, which Ray moves without pickling each tensor's storage). ``on_device``: left where the learner
        holds them (a colocated engine in this process reads them there: no host copy; a tensor in the engine's
        dtype already may be the parameter itself, so the caller writes it before the next step)."""

        dt = resolve_dtype(dtype, self.device)
        # sharded: every rank takes part in each gather (full_tensor, once per tensor); rank 0's copy is sent
        full = {n: shards.full(self.named[n].detach()).to(dtype=dt) for n in self.chunks[k]}
        if on_device:
            return full if self.rank == 0 or everywhere else {}
        return Tensors({n: t.to("cpu", copy=True) for n, t in full.items()} if self.rank == 0 or everywhere else {})

    def probe_logprobs(self, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
        """log p of each probe completion token as the learner scores its batches (same precision, temperature and
        chunked head): what the engine's log-probs are compared with after a sync."""
        import torch

        ids, attn, mask = self._pad([{"prompt_ids": list(prompt_ids), "completion_ids": list(completion_ids)}])
        self.model.eval()
        try:
            with torch.no_grad():
                logp = self._log_probs(self.model, ids, attn, mask)[0]
        finally:
            self.model.train()
        return logp[mask.bool()].tolist()

    def save(self, path: str, meta: dict) -> str:
        """An HF-format checkpoint (what es-eval and es-drift read) with the optimizer, scheduler and RNG state. A
        sharded learner writes no whole copy anywhere: each rank saves its rows of AdamW's moments into the
        checkpoint's ``shards/`` (grpo.shards: resharded on load, so any grpo.fsdp_size resumes), and the HF weights are
        written tensor by tensor, each gathered (full_tensor) only while rank 0 writes it. Published atomically with a
        manifest of every file (es_ray.runtime.checkpoint)."""
        import torch

        rng = {"scheduler": self.scheduler.state_dict(), "torch_rng": torch.get_rng_state(), "step": meta.get("step")}
        meta = {**meta, "fsdp_size": self.world}
        if not self.sharded:  # each parameter read as written (cast to fp32 there if it is not), never all copied
            weights = {n: p.detach() for n, p in self.named.items()}
            save_checkpoint(
                path, weights, self.model_dir, {"optimizer": self.optimizer.state_dict(), **rng}, meta, "grpo"
            )
            return path
        if self.host_params is not None:
            raise ConfigError(
                "grpo.offload=optimizer with grpo.fsdp_size>1 cannot be checkpointed yet; set "
                "run.checkpoint_every=0 or grpo.offload=none"
            )

        where = self.group.broadcast(
            str(staging_dir(Path(path).parent / f"{Path(path).name}-shards")) if self.rank == 0 else None
        )
        save_moments(where, self._sharded_optimizer_state(), self.rank, self.world)
        self.group.barrier()  # every rank's moments are written before rank 0 publishes them
        state = {
            "optimizer": {"moments": "shards", "lr": [group["lr"] for group in self.optimizer.param_groups]},
            **rng,
        }
        if self.rank == 0:
            move = lambda tmp: shutil.move(where, tmp / "shards")  # noqa: E731
            save_checkpoint(
                path, {n: _Gathered(p) for n, p in self.named.items()}, self.model_dir, state, meta, "grpo", extra=move
            )
        else:  # the same gathers, in the order rank 0 writes them (sorted names)
            for name in sorted(self.named):
                shards.full(self.named[name].detach())
        self.group.barrier()  # no rank returns before the checkpoint is published
        return path

    def _sharded_optimizer_state(self, fresh: bool = False) -> dict:
        """AdamW's state by HF parameter name, each moment as this rank's DTensor shard (grpo.shards saves and
        reshards them); ``fresh``: zeros of the right layout to load into."""
        import torch

        out = {}
        for name, p in self.named.items():
            if not p.requires_grad:
                continue
            if fresh or p not in self.optimizer.state:
                out[name] = {
                    "step": torch.zeros((), dtype=torch.float32),
                    "exp_avg": torch.zeros_like(p),
                    "exp_avg_sq": torch.zeros_like(p),
                }
            else:
                out[name] = self.optimizer.state[p]
        return out

    def load(self, path: str) -> dict:
        """Weights, optimizer, scheduler and RNG from a checkpoint written by ``save`` (verified first); returns its
        meta. A sharded learner reads its own shards of AdamW's state, resharded from whatever grpo.fsdp_size wrote
        them; a one-process learner refuses a sharded checkpoint (and the reverse), naming the key."""
        import torch

        verify_dir(path)  # every file against its digest, before anything is read
        saved = read_meta(path, "grpo").get("fsdp_size", 1)
        sharded = (Path(path) / "shards").is_dir()
        if sharded != (self.sharded and self.host_params is None):
            raise ConfigError(
                f"{path} was saved by a {'sharded' if sharded else 'one-process'} learner "
                f"(grpo.fsdp_size={saved}); resume with grpo.fsdp_size="
                f"{saved if sharded else 1}" + ("" if sharded else " grpo.offload=none")
            )
        self._read_rows(path)  # this rank's rows of each tensor, one tensor at a time: never the whole fp32 model
        if self.host_params is not None:  # grpo.offload=optimizer: AdamW steps the host copies, so they load too
            with torch.no_grad():
                for hp, p in zip(self.host_params, self.params):
                    hp.copy_(shards.local(p))
        state = load_state(path, "grpo")  # weights_only=True: a planted pickle is refused
        if sharded:  # this rank's rows of every moment, from whichever saved ranks hold them
            moments = load_moments(Path(path) / "shards", self._sharded_optimizer_state(fresh=True))
            for name, p in self.named.items():
                if name in moments:
                    self.optimizer.state[p] = moments[name]
            for group, lr in zip(self.optimizer.param_groups, state["optimizer"]["lr"]):
                group["lr"] = lr
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        return read_meta(path, "grpo")


def _empty_model(model_dir: str):
    """The fp32 model with its parameters on the meta device (no storage) and its buffers real (rotary frequencies
    are computed at construction, and a meta buffer would have no values to keep)."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
    model.tie_weights()  # from_config leaves a tied head its own meta tensor; from_pretrained ties it
    return model


def _scorer(learner: GRPOLearner):
    """The FSDP2 root: a module holding the policy whose forward is the learner's whole scoring pass."""
    import torch

    class Scorer(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, ids, attn, mask, entropy=False, samples=None):
            return learner._score(self.model, ids, attn, mask, entropy, samples)

    return Scorer(learner.model)


class _Gathered:
    """A sharded parameter that becomes its whole tensor only when the checkpoint writer reads it (``detach``:
    full_tensor, a collective the other ranks join in the same order)."""

    def __init__(self, p):
        self.p, self.shape = p, p.shape

    def detach(self):
        return shards.full(self.p.detach())
