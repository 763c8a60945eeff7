"""Messages between the ES driver and its actors: integers and floats only, never a tensor.

tests/es/test_protocol.py measures their serialized sizes, so a tensor smuggled in would fail it.
"""

from __future__ import annotations

from dataclasses import dataclass

from es_ray.strategy import Member


@dataclass(frozen=True)
class EvalRequest:
    """Score these members of iteration ``iteration`` on the training prompts ``prompt_ids``."""

    iteration: int
    sigma: float
    members: tuple[Member, ...]
    prompt_ids: tuple[int, ...]
    sample_seed: int
    """Sampling seed shared by every member of the iteration (common random numbers)."""
    report_progress: bool = False
    """Report the members scored as they are (``runtime.actors.report_progress``): only while a progress bar
    reads them, so a run without one pays no store write per member."""


@dataclass(frozen=True)
class MemberResult:
    index: int
    reward: float
    """Mean reward over the iteration's completions (every prompt, every sample)."""
    tokens: int
    reward_errors: int
    """Completions whose reward function raised (scored 0)."""
    fitness: float | None = None
    """The member's raw fitness: the mean over prompts of each prompt's value under task.objective (None: reward)."""
    prompt_values: tuple[float, ...] = ()
    """Each prompt's value, in prompt_ids order, sent only where the driver needs them (es.fitness_baseline=
    per_prompt): P scalars a member, never a completion."""


@dataclass(frozen=True)
class EvalResult:
    members: tuple[MemberResult, ...]
    timing_s: dict[str, float]
    """Seconds spent by the actor per phase: perturb, generate, reward, restore."""


@dataclass(frozen=True)
class UpdateRequest:
    iteration: int
    sigma: float
    members: tuple[Member, ...]
    fitness: tuple[float, ...]
    """Shaped fitness z_i, indexed by member index."""
    want_checksum: bool


@dataclass(frozen=True)
class UpdateResult:
    update_norm: float
    realised_cos: float | None
    """cos(realised, intended update), measured by reading the engine back; None where it cannot be read back
    (vLLM with tensor parallelism) or the intended update is zero."""
    realised_norm: float | None
    checksum: str
    """Hex digest of the master weights ('' when not requested)."""
    seconds: float


@dataclass(frozen=True)
class SeedRecord:
    """One iteration of the seed log (``seed_log.jsonl``; with the initial weights and config.json the log
    determines the run). The update it applied is ``update_request()``: what the driver sends every actor and what a
    rebuilt or resumed actor replays are the same object."""

    iteration: int
    sigma: float
    lr: float
    members: tuple[Member, ...]
    rewards: tuple[float, ...]
    """Raw rewards, indexed by member index."""
    fitness: tuple[float, ...]
    """Shaped fitness z_i, indexed by member index (JSON floats round-trip exactly, so a replay is exact)."""
    checksum: str | None = None
    """The replicas' checksum after the update (None until every actor has applied it)."""

    def update_request(self, want_checksum: bool = False) -> UpdateRequest:
        return UpdateRequest(self.iteration, self.sigma, self.members, self.fitness, want_checksum)

    def to_json(self) -> dict:
        out = {
            "iteration": self.iteration,
            "sigma": self.sigma,
            "lr": self.lr,
            "members": [[m.index, m.noise_id, m.sign] for m in self.members],
            "rewards": list(self.rewards),
            "fitness": list(self.fitness),
        }
        return out if self.checksum is None else {**out, "checksum": self.checksum}

    @classmethod
    def from_json(cls, row: dict) -> SeedRecord:
        return cls(
            int(row["iteration"]),
            float(row["sigma"]),
            float(row.get("lr", 0.0)),
            tuple(Member(*m) for m in row["members"]),
            tuple(row.get("rewards", ())),
            tuple(row["fitness"]),
            row.get("checksum"),
        )
