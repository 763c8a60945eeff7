"""transformers engine: CPU and GPU, batched generate, weights written in place through named_parameters(),
teacher-forced log-probs and entropy from one forward pass, and the ES replica in the same process; low-rank
members generated together in one batch (``hf_lowrank``)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Sequence

import torch

from es_ray.engines.base import (
    Completion,
    Engine,
    InProcessReplicaHost,
    ReplicaHost,
    patched_attribute,
    check_context,
    check_temperature,
    resolve_device,
)
from es_ray.engines.hf_lowrank import Factors, LowRankTerms, population_calls
from es_ray.metrics.entropy import batched_completion_entropies, completion_entropies, completion_log_probs
from es_ray.metrics.prefix import prompt_groups, shared_prefill
from es_ray.core.config import EngineConfig, SamplingConfig
from es_ray.core.dtypes import resolve_dtype
from es_ray.lowrank import LowRankSlots

# transformers is imported where a model is built: importing the engine (its traits, the factory) costs torch only.


class HFEngine(Engine):
    name = "hf"
    can_score_entropy = True

    def __init__(self, model_dir: str, cfg: EngineConfig, lowrank: LowRankSlots | None = None):
        super().__init__(model_dir, cfg, lowrank)
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        self.device = resolve_device(cfg)
        self.dtype = resolve_dtype(cfg.dtype, self.device, "engine.dtype")
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=self.dtype).to(self.device)
        self.model.eval()
        self.model.requires_grad_(False)
        self.params = dict(self.model.named_parameters())
        self.eos_ids = self._eos_ids()
        self._host: ReplicaHost | None = None

    def _eos_ids(self) -> set[int]:
        ids = {self.tokenizer.eos_token_id}
        gen_eos = getattr(self.model.generation_config, "eos_token_id", None)
        ids.update(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])
        return {i for i in ids if i is not None}

    @torch.inference_mode()
    @contextlib.contextmanager
    def lowrank_term_off(self):
        """Each perturbed layer's term an output of zeros (plus the bias), into which the base GEMM accumulates as into
        the term (``hf_lowrank.base_gemm``)."""

        def off(terms, layer, x, bias=None):
            k = terms.members.stop - terms.members.start
            shape = (k, x.numel() // (k * x.shape[-1]), terms.bt[layer].shape[-1])
            return torch.zeros(shape, dtype=x.dtype, device=x.device) if bias is None else bias.expand(shape).clone()

        with patched_attribute(LowRankTerms, "term", off):
            yield

    def generate(
        self, prompts: list[str], sampling: SamplingConfig, seed: int | Sequence[int], share_prompts: bool = True
    ) -> list[Completion]:
        """``share_prompts=False`` prefills every row, also rows with equal prompts: the work of a low-rank
        population's batch of the same rows, whose members cannot share a prefill (benchmarks/population.py).
        ``seed`` a sequence: one seed per row, each row sampled from its own generator (``RowSampler``)."""
        out: list[Completion] = []
        row_seeds = [int(s) for s in seed] if isinstance(seed, (list, tuple)) else None
        gen = torch.Generator(device="cpu").manual_seed(0 if row_seeds is not None else int(seed))
        for start in range(0, len(prompts), self.cfg.batch_size):
            batch = prompts[start : start + self.cfg.batch_size]
            enc = self._encode(batch, sampling.max_new_tokens)
            groups = prompt_groups(batch)
            # rows with equal prompts (eval.n samples of a problem, a GRPO group): their prompt is prefilled once
            cache = (
                shared_prefill(self.model, enc["input_ids"], enc["attention_mask"], groups)
                if share_prompts and len(groups) < len(batch)
                else None
            )
            rows = row_seeds[start : start + len(batch)] if row_seeds is not None else None
            out += self._generate_rows(enc, sampling, gen, cache, rows)
        return out

    @torch.inference_mode()
    def generate_population(
        self, factors: Factors, prompts: list[str], sampling: SamplingConfig, seed: int
    ) -> list[list[Completion]]:
        """es.perturbation=lowrank: the completions of ``prompts`` for each member of ``factors``
        (``Replica.member_factors``), as many members per generate call as ``engine.batch_size`` rows hold, each
        row seeing its member's weights through a low-rank term (``hf_lowrank.LowRankTerms``); the weights are not
        touched. The prompts are cut and padded as ``generate`` cuts them, so greedy completions equal a member's
        own; sampling draws one seed per call from ``seed``."""
        num_members = len(next(iter(factors.values()))[0])
        out: list[list[Completion]] = [[] for _ in range(num_members)]
        gen = torch.Generator(device="cpu").manual_seed(int(seed))
        with LowRankTerms(self.model, factors) as terms:
            for chunk, members in population_calls(len(prompts), num_members, self.cfg.batch_size):
                enc = self._encode(prompts[chunk], sampling.max_new_tokens)
                rows = {k: v.repeat(len(members), 1) for k, v in enc.items()}  # member-major
                terms.select(members)
                done = self._generate_rows(rows, sampling, gen)
                per_member = len(done) // len(members)
                for j, m in enumerate(members):
                    out[m] += done[j * per_member : (j + 1) * per_member]
        return out

    def _encode(self, prompts: list[str], max_new_tokens: int = 0) -> dict[str, torch.Tensor]:
        enc = self.tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        check_context(
            enc["attention_mask"].sum(1).tolist(),
            max_new_tokens,
            getattr(self.model.config, "max_position_embeddings", None),
        )
        return {k: v.to(self.device) for k, v in enc.items()}

    def _generate_rows(
        self,
        enc: dict[str, torch.Tensor],
        sampling: SamplingConfig,
        gen: torch.Generator,
        cache=None,
        row_seeds: list[int] | None = None,
    ) -> list[Completion]:
        """One ``model.generate`` call over the encoded rows; a sampled call seeds from ``gen``, or each row from
        its own of ``row_seeds``. ``cache``: the rows' prompts but their last token, already prefilled
        (``prefix.shared_prefill``)."""
        greedy = sampling.temperature <= 0
        kwargs: dict[str, Any] = dict(
            max_new_tokens=sampling.max_new_tokens, do_sample=not greedy, pad_token_id=self.tokenizer.pad_token_id
        )
        if cache is not None:
            kwargs["past_key_values"] = cache
        if greedy:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        elif row_seeds is not None:  # the row's own draw, taken as the argmax of Gumbel-perturbed logits
            from transformers import LogitsProcessorList

            kwargs.update(
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                logits_processor=LogitsProcessorList([RowSampler(row_seeds, sampling)]),
            )
        else:
            kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
            # transformers samples from the global RNG: seed it per batch from our own generator
            torch.manual_seed(int(torch.randint(0, 2**62, (1,), generator=gen)))
        ids = self.model.generate(**enc, **kwargs)[:, enc["input_ids"].shape[1] :].tolist()
        out = []
        for row in ids:
            n = len(row)
            for j, tok in enumerate(row):
                if tok in self.eos_ids:
                    n = j + 1
                    break
            text = self.tokenizer.decode(row[:n], skip_special_tokens=True)
            out.append(Completion(text=text, num_tokens=n, token_ids=tuple(row[:n])))
        return out

    def token_logprobs(self, prompt_ids: list[int], completion_ids: list[int], temperature: float = 1.0) -> list[float]:
        return completion_log_probs(self.model, prompt_ids, completion_ids, check_temperature(temperature)).tolist()

    def token_entropies(
        self, prompt_ids: list[int], completion_ids: list[int], temperature: float = 1.0
    ) -> list[float]:
        return completion_entropies(self.model, prompt_ids, completion_ids, check_temperature(temperature)).tolist()

    def entropies_batch(
        self, pairs: list[tuple[list[int], list[int]]], temperatures: tuple[float, ...], top_p: float = 1.0
    ) -> list[list[list[float]]]:
        temps = [check_temperature(t) for t in temperatures]
        budget = max(512, self.cfg.batch_size * 128)  # padded tokens per forward pass
        return [
            h.tolist()
            for h in batched_completion_entropies(self.model, pairs, temps, max_batch_tokens=budget, top_p=top_p)
        ]

    @torch.no_grad()
    def write_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, t in named:
            param = self.params.get(name)
            if param is None:
                raise KeyError(f"engine has no parameter {name!r}")
            param.copy_(t)

    def read(self, name: str) -> torch.Tensor:
        """The parameter itself (engine dtype and device, no copy): the replica's read-back."""
        return self.params[name]

    def read_weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu", torch.float32, copy=True) for k, v in self.params.items()}

    def replica_host(self) -> ReplicaHost:
        if self._host is None:
            self._host = InProcessReplicaHost(
                self.model_dir, self.params, self.write_weights, self.read, self.device, self.generate_population
            )
        return self._host


class RowSampler:
    """A logits processor that samples each row of a batch from a generator of its own (seeded by the row's seed):
    softmax(logits / temperature) cut to its top_p nucleus, drawn by the Gumbel-max trick, so greedy decoding over
    its output picks the sample. A row draws one uniform per vocabulary entry per step whatever else is in the
    batch, so its completion depends on its seed and prompt only (transformers' own sampling draws from one
    global generator for the whole batch)."""

    def __init__(self, seeds: list[int], sampling: SamplingConfig):
        self.gens = [torch.Generator(device="cpu").manual_seed(int(s) % (1 << 63)) for s in seeds]
        self.temperature, self.top_p = float(sampling.temperature), float(sampling.top_p)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logits = scores.float() / self.temperature  # (rows, vocab)
        if self.top_p < 1.0:
            order = logits.argsort(dim=-1, descending=True)
            probs = logits.gather(-1, order).softmax(-1)
            outside = probs.cumsum(-1) - probs >= self.top_p  # the mass before a token already reaches top_p
            logits = logits.scatter(-1, order, logits.gather(-1, order).masked_fill(outside, float("-inf")))
        u = torch.stack([torch.rand(logits.shape[-1], generator=g, dtype=torch.float64) for g in self.gens])
        gumbel = -torch.log(-torch.log(u.clamp_min(1e-300)))
        return logits + gumbel.to(logits.device, logits.dtype)
