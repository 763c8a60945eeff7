"""es.perturbation: how ES perturbs a member, one object per mode, registered in ``PERTURBATIONS`` (which is also
the config check). Everything that differs between the modes is here, as what a mode is rather than its name:
which tensors it perturbs, what an engine reserves for it, what it checks against the model, whether an actor's
members are generated together or one by one, and whether its noise (and so its update) is drawn as low-rank
factors. The rest of the code asks the object (``ReplicaSpec.kind``), never compares the name. A third mode is an
instance here; the replica, the worker and the memory plan follow its attributes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Mapping

from es_ray.core.registry import Registry

if TYPE_CHECKING:
    from es_ray.lowrank import LowRankSlots

# es_ray.lowrank (torch) is imported where low rank is used: the config's check imports no torch.


@dataclass(frozen=True)
class Perturbation:
    name: str
    """The es.perturbation value."""
    description: str
    factored: bool
    """The noise of each perturbed tensor is drawn as factors, E = B A^T / sqrt(es.rank) (``es_ray.lowrank``), and
    the update is summed from the factors (``lowrank.gradient``, one matmul whose rounding depends on the device's
    GEMM kernels); otherwise each trainable tensor draws its own full-rank Gaussian."""
    batched: bool
    """An actor's members are generated together in one batched pass, each sequence seeing its member's weights
    through a term of its own, the weights holding cast(master) throughout (the engine's population path);
    otherwise an actor perturbs, generates and restores member by member."""

    def selects(self, name: str, shape: Iterable[int] | None) -> bool:
        """Whether a trainable tensor (the model.trainable regex already matched) is perturbed: every one, or for
        factored noise the linear-layer weights only (``lowrank.is_target``; without a shape: not yet known)."""
        if shape is None or not self.factored:
            return True
        from es_ray.lowrank import is_target  # torch, imported where a model is at hand (not by the driver)

        return is_target(name, shape)

    def target_note(self) -> str:
        """How an error about the selected tensors names this mode's restriction."""
        return f" that es.perturbation={self.name} perturbs (linear-layer weights)" if self.factored else ""

    def members_at_once(self, population: int, num_actors: int) -> int:
        """The most members one actor generates at once (member i goes to actor i % num_actors); 0 when one at a
        time (the engine's batch then holds one member's prompts)."""
        return -(-population // max(1, num_actors)) if self.batched else 0

    def slots(self, population: int, num_actors: int, rank: int) -> LowRankSlots | None:
        """What the engine reserves: a slot per member generated at once, at ``rank``; None for none."""
        from es_ray.lowrank import LowRankSlots

        members = self.members_at_once(population, num_actors)
        return LowRankSlots(members=members, rank=rank) if members else None

    def check_model(self, rank: int, shapes: Callable[[], Mapping[str, Iterable[int]]]) -> None:
        """Before any actor starts: factored noise needs 1 <= rank <= min(out, in) of every perturbed tensor
        (``shapes`` reads them, only when needed)."""
        if self.factored:
            from es_ray.lowrank import check_rank

            check_rank(rank, shapes())


FULL = Perturbation(
    "full",
    "every trainable tensor gets its own full-rank Gaussian noise, written into the weights "
    "per member (the paper's ES)",
    factored=False,
    batched=False,
)
LOWRANK = Perturbation(
    "lowrank",
    "each linear layer's weight gets sigma * B A^T / sqrt(es.rank); all members are "
    "generated in one batched pass (transformers: a per-member low-rank term; vLLM: one LoRA slot "
    "per member)",
    factored=True,
    batched=True,
)
PERTURBATIONS = Registry("es.perturbation", {p.name: p for p in (FULL, LOWRANK)})
