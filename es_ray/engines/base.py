"""The engine interface shared by ES actors, GRPO rollout actors and evaluation, in two roles.

``Engine`` (generation): holds one model loaded from a local HF directory; generates from already-templated
prompts, scores given tokens under its own weights and kernels (log-probs; entropy where it can), carries the
tokenizer, and reads and writes weights by HF parameter name.

``ReplicaHost`` (ES): the fp32 master replica (``es_ray.replica``) next to the engine's weights, so that a
perturbation never leaves the process that owns them: in-process for transformers (``InProcessReplicaHost``),
inside vLLM's worker for vLLM (``vllm.VLLMReplicaHost``, which sends only plain scalars and the ``ReplicaSpec``).

``make_engine`` builds the engine that the ``ENGINES`` registry names; nothing outside ``es_ray.engines`` asks which
engine it holds.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from es_ray.engines import ENGINES
from es_ray.lowrank import LowRankSlots
from es_ray.replica import Reader, Replica, ReplicaSpec, Writer
from es_ray.core.config import ConfigError, EngineConfig, SamplingConfig
from es_ray.strategy import Member


@dataclass(frozen=True)
class Completion:
    text: str
    num_tokens: int
    """Generated tokens, the end-of-sequence token included when one was produced."""
    token_ids: tuple[int, ...] = ()
    """The generated token ids (for teacher-forced scoring without re-tokenising); empty if not kept."""


class ReplicaHost(ABC):
    """The ES role of an engine: one fp32 master replica where the engine's weights live."""

    @abstractmethod
    def setup(self, spec: ReplicaSpec) -> None:
        """Build the replica from the checkpoint's fp32 tensors and write cast(master) into the engine."""

    @abstractmethod
    def perturb(self, iteration: int, noise_id: int, sign: int, sigma: float) -> None:
        """Write cast(master + sign * sigma * eps) into the engine."""

    @abstractmethod
    def restore(self) -> None:
        """Write cast(master) into the engine."""

    @abstractmethod
    def update(self, iteration: int, members: list[Member], fitness: list[float], sigma: float) -> dict:
        """One ES step on the master, written into the engine; health scalars (``Replica.update``)."""

    def generate_members(
        self,
        iteration: int,
        members: list[Member],
        sigma: float,
        prompts: list[str],
        sampling: SamplingConfig,
        seed: int,
    ) -> list[list[Completion]]:
        """es.perturbation=lowrank (population batching): every member's completions of ``prompts`` (one list per
        member, in order), generated together in batched passes in which member m's sequences see the weights
        cast(master) + sign * sigma * E_m (E_m = B_m A_m^T / sqrt(r), ``es_ray.lowrank``) through a low-rank term,
        never written into the weights. The engine holds cast(master) before and after. ``seed`` as in
        ``Engine.generate`` (greedy: a member's completions equal those it gets alone)."""
        raise NotImplementedError(
            f"{type(self).__name__} does not batch a population: es.perturbation=lowrank needs engine.name=hf or vllm"
        )

    @abstractmethod
    def checksum(self) -> str:
        """Digest of the master weights."""

    @abstractmethod
    def state_dict(self) -> dict:
        """Master, optimizer state and theta_0 (checkpoints)."""

    @abstractmethod
    def load_state_dict(self, sd: dict) -> None:
        """Replace the master and optimizer state, then write cast(master) into the engine."""


PopulationGenerator = Callable[
    [Mapping[str, tuple[torch.Tensor, torch.Tensor]], list[str], SamplingConfig, int], list[list[Completion]]
]
"""(member factors (``Replica.member_factors``), prompts, sampling, seed) -> completions per member: an engine's
batched generation of a low-rank population."""


class InProcessReplicaHost(ReplicaHost):
    """The replica in the caller's own process (transformers engine): every call is a plain method call.
    ``generate_population``: the engine's batched generation of low-rank members (``generate_members``)."""

    def __init__(
        self,
        model_dir: str,
        names: Iterable[str],
        write: Writer,
        read: Reader,
        device: str,
        generate_population: PopulationGenerator | None = None,
    ):
        self.model_dir, self.names, self.write, self.read, self.device = model_dir, list(names), write, read, device
        self.generate_population = generate_population
        self._replica: Replica | None = None

    def setup(self, spec: ReplicaSpec) -> None:
        self._replica = Replica.from_checkpoint(self.model_dir, self.names, spec, self.write, self.read, self.device)
        self._replica.direct = True  # ``read`` returns the parameters the model computes with

    @property
    def replica(self) -> Replica:
        if self._replica is None:
            raise RuntimeError("ReplicaHost.setup(spec) must run before any other ES call")
        return self._replica

    def perturb(self, iteration: int, noise_id: int, sign: int, sigma: float) -> None:
        self.replica.perturb(iteration, noise_id, sign, sigma)

    def restore(self) -> None:
        self.replica.restore()

    def update(self, iteration: int, members: list[Member], fitness: list[float], sigma: float) -> dict:
        return self.replica.update(iteration, members, fitness, sigma)

    def generate_members(
        self,
        iteration: int,
        members: list[Member],
        sigma: float,
        prompts: list[str],
        sampling: SamplingConfig,
        seed: int,
    ) -> list[list[Completion]]:
        if self.generate_population is None:
            return super().generate_members(iteration, members, sigma, prompts, sampling, seed)
        if not self.replica.spec.kind.batched:
            raise RuntimeError(
                f"generate_members batches low-rank members, and this replica was set up with "
                f"es.perturbation={self.replica.spec.perturbation}: set es.perturbation=lowrank, or "
                "evaluate members one at a time (perturb, generate, restore)"
            )
        if not members:
            return []
        return self.generate_population(self.replica.member_factors(iteration, members, sigma), prompts, sampling, seed)

    def checksum(self) -> str:
        return self.replica.checksum()

    def state_dict(self) -> dict:
        return self.replica.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.replica.load_state_dict(sd)


class Engine(ABC):
    """The generation role. Token ids are the engine tokenizer's; a temperature T means the distribution
    softmax(logits / T), the one sampling at T draws from (docs/design.md "A fair comparison")."""

    name: str = "base"
    can_score_entropy: bool = False
    """Whether ``token_entropies`` works at evaluation scale on the engine's own weights."""
    tokenizer: Any
    """The HF tokenizer of the loaded model (set by the constructor)."""

    def __init__(self, model_dir: str, cfg: EngineConfig, lowrank: LowRankSlots | None = None):
        """``lowrank``: reserve room to batch up to ``lowrank.members`` low-rank members of rank ``lowrank.rank``
        (vLLM: LoRA slots; ES actors with es.perturbation=lowrank pass it)."""
        self.model_dir = str(model_dir)
        self.cfg = cfg
        self.lowrank = lowrank

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        """Messages -> prompt text with the model's chat template and the generation prompt."""
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return "\n".join(m["content"] for m in messages) + "\n"

    @abstractmethod
    def generate(
        self, prompts: list[str], sampling: SamplingConfig, seed: int | Sequence[int], share_prompts: bool = True
    ) -> list[Completion]:
        """One completion per prompt; ``seed`` fixes the sampling so equal calls give equal outputs. A sequence of
        seeds, one per prompt, gives each row a stream of its own: its completion then does not depend on which
        other rows share the call or the batch (GRPO's rollouts, however many actors draw them).
        ``share_prompts=False``: every row prefilled on its own, also rows with equal prompts (what a low-rank
        population's members, under different weights, cannot share; benchmarks/population.py's reference)."""

    @abstractmethod
    def token_logprobs(self, prompt_ids: list[int], completion_ids: list[int], temperature: float = 1.0) -> list[float]:
        """log p(completion token | prefix) of softmax(logits / temperature), per completion token, under the
        engine's own weights and kernels (the GRPO sync probe compares it with the learner's)."""

    def token_entropies(
        self, prompt_ids: list[int], completion_ids: list[int], temperature: float = 1.0
    ) -> list[float]:
        """Entropy (nats) of softmax(logits / temperature) at each completion token, teacher-forced. Only where
        ``can_score_entropy``."""
        raise NotImplementedError(
            f"engine.name={self.name} does not score token entropy (can_score_entropy is "
            "False): score with a transformers model of the same checkpoint"
        )

    def entropies_batch(
        self, pairs: list[tuple[list[int], list[int]]], temperatures: tuple[float, ...], top_p: float = 1.0
    ) -> list[list[list[float]]]:
        """Per (prompt ids, completion ids) pair, per completion token, the entropy at each temperature: what es-eval
        scores (top_p < 1: one more, the renormalised nucleus at temperatures[0]). The default asks
        ``token_entropies`` once per pair and temperature; an engine with a batched forward overrides it."""
        if top_p < 1.0:
            raise NotImplementedError(f"engine.name={self.name} does not score the top_p nucleus's entropy")
        return [[list(row) for row in zip(*(self.token_entropies(p, c, t) for t in temperatures))] for p, c in pairs]

    @abstractmethod
    def write_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy (HF name, tensor) pairs into the engine, casting to its dtype (consumed one at a time)."""

    @abstractmethod
    def read_weights(self) -> dict[str, torch.Tensor]:
        """The engine's weights by HF name, as fp32 CPU tensors (checkpoints, GRPO, tests)."""

    @abstractmethod
    def replica_host(self) -> ReplicaHost:
        """The engine's ES role (one per engine); ``setup(spec)`` it before use."""

    def close(self) -> None:
        """Release what the engine holds beyond its Python objects (vLLM: its engine core and process groups)."""

    def lowrank_term_off(self):
        """A context in which the low-rank members' term adds nothing and the rest of the population's generation loop
        runs as it is: the reference a benchmark measures the term's own cost against (benchmarks/population.py)."""
        raise NotImplementedError(f"the {self.name} engine cannot switch its low-rank term off")


@contextlib.contextmanager
def patched_attribute(cls, name: str, value):
    """``cls.name`` replaced by ``value`` for the context, restored however it ends."""
    saved = cls.__dict__[name]
    setattr(cls, name, value)
    try:
        yield
    finally:
        setattr(cls, name, saved)


def check_context(prompt_lengths: Iterable[int], max_new_tokens: int, context: int | None) -> None:
    """The engines' one rule for long prompts: a prompt that leaves less than ``max_new_tokens`` of the model's
    context is refused, never cut (a cut question is another question, and its reward would grade that one)."""
    longest = max(prompt_lengths, default=0)
    if context and longest + max_new_tokens > context:
        raise ConfigError(
            f"a prompt of {longest} tokens with max_new_tokens={max_new_tokens} does not fit the "
            f"model's context of {context} tokens: lower the sampling's max_new_tokens, raise "
            "engine.max_model_len where the model allows it, or leave the longest rows out of the task"
        )


def check_temperature(temperature: float) -> float:
    if not temperature > 0:
        raise ValueError(f"scoring needs a temperature > 0 (got {temperature}): greedy decoding has no log-probs")
    return float(temperature)


def resolve_device(cfg: EngineConfig) -> str:
    if cfg.device != "auto":
        return cfg.device
    return "cuda" if torch.cuda.is_available() else "cpu"


def make_engine(model_dir: str, cfg: EngineConfig, lowrank: LowRankSlots | None = None) -> Engine:
    """The engine registered under engine.name, built on ``model_dir`` (``lowrank``: ``Engine.__init__``)."""
    traits = ENGINES.get(cfg.name)
    try:
        return traits.build(model_dir, cfg, lowrank)
    except ImportError as exc:  # the engine's own package missing: say how to install it; anything else raises
        if (exc.name or "").partition(".")[0] != traits.package:
            raise
        others = ", ".join(n for n in ENGINES.names() if n != cfg.name)
        raise RuntimeError(
            f"engine.name={cfg.name} needs {traits.package} ({exc}); {traits.install}, or use "
            f"engine.name= one of {others}"
        ) from exc
