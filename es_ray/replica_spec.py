"""The replica's settings (``ReplicaSpec``): plain scalars, no torch, so the driver builds and checks one without
importing it. The replica itself is ``es_ray.replica``'s, which re-exports this."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable

from es_ray.perturbation import PERTURBATIONS, Perturbation


def _from(key: str):
    """A ReplicaSpec field set from the config key ``key`` (a dotted path into ESTrainConfig)."""
    return field(metadata={"config": key})


def selects(trainable: str, perturbation: str, name: str, shape: Iterable[int] | None = None) -> bool:
    """Whether the replica holds the tensor ``name``: model.trainable (``trainable``) is a regex (empty selects all),
    and with es.perturbation=lowrank only linear-layer weights are (``lowrank.is_target``; needs ``shape``). The
    memory plan asks the same question of a model's shape."""
    if trainable and re.search(trainable, name) is None:
        return False
    return PERTURBATIONS.get(perturbation).selects(name, shape)


@dataclass(frozen=True)
class ReplicaSpec:
    """Every setting the replica needs, as plain scalars: this object itself crosses into vLLM's worker through
    collective_rpc. Each field names its config key, and ``es_ray.es.config.replica_spec`` is the one place a spec
    is built (the replica knows no ES config), so a new field cannot be forgotten on the way (there are no defaults
    to fall back on)."""

    run_seed: int = _from("run.seed")
    noise: str = _from("es.noise")
    noise_table_size: int = _from("es.noise_table_size")
    noise_scope: str = _from("es.noise_scope")
    trainable: str = _from("model.trainable")
    optimizer: str = _from("es.optimizer")
    lr: float = _from("es.lr")
    adam_beta1: float = _from("es.adam_beta1")
    adam_beta2: float = _from("es.adam_beta2")
    adam_eps: float = _from("es.adam_eps")
    weight_decay: float = _from("es.weight_decay")
    anchor_decay: float = _from("es.anchor_decay")
    perturbation: str = _from("es.perturbation")
    rank: int = _from("es.rank")

    def selects(self, name: str, shape: Iterable[int] | None = None) -> bool:
        """Whether the tensor ``name`` is trainable (``selects``)."""
        return selects(self.trainable, self.perturbation, name, shape)

    @property
    def kind(self) -> Perturbation:
        """The es.perturbation mode (``es_ray.perturbation``)."""
        return PERTURBATIONS.get(self.perturbation)
