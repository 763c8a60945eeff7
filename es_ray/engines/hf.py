"""transformers engine: CPU and GPU, batched generate, weights written in place through named_parameters()."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import torch

from es_ray.runtime.config import EngineConfig, SamplingConfig
from es_ray.engines.base import Completion, Engine, resolve_device, torch_dtype
from es_ray.replica import Replica, ReplicaSpec


class HFEngine(Engine):
    name = "hf"

    def __init__(self, model_dir: str, cfg: EngineConfig):
        super().__init__(model_dir, cfg)
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        self.device = resolve_device(cfg)
        self.dtype = torch_dtype(cfg.dtype, self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=self.dtype).to(self.device)
        self.model.eval()
        self.model.requires_grad_(False)
        self.params = dict(self.model.named_parameters())
        self.eos_ids = self._eos_ids()
        self.replica: Replica | None = None

    def _eos_ids(self) -> set[int]:
        ids = {self.tokenizer.eos_token_id}
        gen_eos = getattr(self.model.generation_config, "eos_token_id", None)
        ids.update(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])
        return {i for i in ids if i is not None}

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        if self.tokenizer.chat_template:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return "\n".join(m["content"] for m in messages) + "\n"

    @torch.inference_mode()
    def generate(self, prompts: list[str], sampling: SamplingConfig, seed: int) -> list[Completion]:
        out: list[Completion] = []
        greedy = sampling.temperature <= 0
        gen = torch.Generator(device="cpu").manual_seed(int(seed))
        for start in range(0, len(prompts), self.cfg.batch_size):
            batch = prompts[start : start + self.cfg.batch_size]
            enc = self.tokenizer(batch, return_tensors="pt", padding=True, add_special_tokens=False).to(self.device)
            kwargs: dict[str, Any] = dict(max_new_tokens=sampling.max_new_tokens, do_sample=not greedy,
                                          pad_token_id=self.tokenizer.pad_token_id)
            if greedy:
                kwargs.update(temperature=None, top_p=None, top_k=None)
            else:
                kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
                # transformers samples from the global RNG: seed it per batch from our own generator
                torch.manual_seed(int(torch.randint(0, 2**62, (1,), generator=gen)))
            ids = self.model.generate(**enc, **kwargs)[:, enc["input_ids"].shape[1] :].tolist()
            for row in ids:
                n = len(row)
                for j, tok in enumerate(row):
                    if tok in self.eos_ids:
                        n = j + 1
                        break
                text = self.tokenizer.decode(row[:n], skip_special_tokens=True)
                out.append(Completion(text=text, num_tokens=n, token_ids=tuple(row[:n])))
        return out

    @torch.no_grad()
    def write_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, t in named:
            param = self.params.get(name)
            if param is None:
                raise KeyError(f"engine has no parameter {name!r}")
            param.copy_(t)

    def read_weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu", torch.float32, copy=True) for k, v in self.params.items()}

    def es_setup(self, spec: ReplicaSpec) -> None:
        from es_ray.models import load_hf_weights

        # The master comes from the checkpoint in fp32, not from the (possibly bf16) engine weights.
        spec = dataclasses.replace(spec, engine_dtype=str(self.dtype).removeprefix("torch."))
        source = load_hf_weights(self.model_dir, self.params)
        named = ((n, source.get(n, p)) for n, p in self.params.items())
        self.replica = Replica(named, spec, self.write_weights, device=self.device)
        self.replica.restore()

    def es_call(self, op: str, *args: Any) -> Any:
        if self.replica is None:
            raise RuntimeError("es_setup must run before es_call")
        return getattr(self.replica, op)(*args)
