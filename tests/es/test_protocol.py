"""Driver <-> actor messages stay tiny: integers, floats and short strings, never a tensor or an array."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest
import torch

from es_ray.es.config import ESConfig, ESTrainConfig
from es_ray.es.driver import prompt_ids, sample_seed
from es_ray.es.protocol import EvalRequest, EvalResult, MemberResult, UpdateRequest, UpdateResult
from es_ray.strategy import ask, shape_fitness

POPULATION = 32
MAX_BYTES = 4096
ALLOWED_LEAVES = (int, float, str, bool, type(None))


def leaves(obj, path="msg"):
    """(path, value) of every leaf below dataclasses, tuples, lists and dicts."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from leaves(getattr(obj, f.name), f"{path}.{f.name}")
    elif isinstance(obj, (tuple, list)):
        for i, x in enumerate(obj):
            yield from leaves(x, f"{path}[{i}]")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from leaves(k, f"{path}.key")
            yield from leaves(v, f"{path}[{k!r}]")
    else:
        yield path, obj


def bad_leaves(msg) -> list[str]:
    out = []
    for path, value in leaves(msg):
        if isinstance(value, (torch.Tensor, np.ndarray, np.generic)) or type(value) not in ALLOWED_LEAVES:
            out.append(f"{path}: {type(value).__name__}")
    return out


def messages():
    cfg = ESTrainConfig(es=ESConfig(population=POPULATION, prompts_per_iteration=16))
    members = tuple(ask(POPULATION, "antithetic"))
    rewards_n = np.random.default_rng(0).uniform(size=POPULATION)
    fitness_n = shape_fitness(rewards_n, "zscore")  # a numpy array, converted as the driver does
    return {
        "EvalRequest": EvalRequest(123, cfg.es.sigma, members, prompt_ids(cfg, 123, 1000), sample_seed(cfg, 123)),
        "UpdateRequest": UpdateRequest(123, cfg.es.sigma, members, tuple(float(z) for z in fitness_n), True),
        "EvalResult": EvalResult(
            tuple(MemberResult(i, float(rewards_n[i]), 16 * 64, 0) for i in range(POPULATION)),
            {"perturb": 1.25, "generate": 30.5, "reward": 0.02, "restore": 0.03},
        ),
        "UpdateResult": UpdateResult(0.0123, 0.998, 0.0121, "0123456789abcdef", 2.5),
    }


MESSAGES = messages()


@pytest.mark.parametrize("kind", sorted(MESSAGES))
def test_message_pickles_small(kind):
    msg = MESSAGES[kind]
    data = pickle.dumps(msg)
    assert len(data) < MAX_BYTES, f"{kind} pickles to {len(data)} bytes"
    assert pickle.loads(data) == msg


@pytest.mark.parametrize("kind", sorted(MESSAGES))
def test_message_holds_only_plain_scalars(kind):
    msg = MESSAGES[kind]
    assert dataclasses.is_dataclass(msg)
    assert bad_leaves(msg) == []


def test_messages_carry_the_whole_population():
    assert len(MESSAGES["EvalRequest"].members) == POPULATION
    assert len(MESSAGES["EvalRequest"].prompt_ids) == 16
    assert len(MESSAGES["UpdateRequest"].fitness) == POPULATION
    assert len(MESSAGES["EvalResult"].members) == POPULATION


def test_the_leaf_walk_finds_smuggled_tensors_and_arrays():
    """The check above is not vacuous: a tensor, an array or a numpy scalar anywhere is reported."""
    members = tuple(ask(4))
    with_tensor = UpdateRequest(0, 1e-3, members, (torch.zeros(3),), False)
    with_array = EvalResult((MemberResult(0, 1.0, 1, 0),), {"generate": np.ones(2)})
    with_np_scalar = UpdateRequest(0, 1e-3, members, tuple(np.zeros(4)), False)
    assert bad_leaves(with_tensor) == ["msg.fitness[0]: Tensor"]
    assert bad_leaves(with_array) == ["msg.timing_s['generate']: ndarray"]
    assert len(bad_leaves(with_np_scalar)) == 4
    big = UpdateRequest(0, 1e-3, members, tuple(float(x) for x in range(1000)), False)
    assert len(pickle.dumps(big)) > MAX_BYTES  # the size bound is tight enough to notice a big payload


def test_seed_record_is_the_update_request_and_its_log_line():
    """A seed-log record round-trips through its JSON line unchanged, and the update it replays is the request the
    driver sent (one type for both, ``SeedRecord.update_request``)."""
    import json

    from es_ray.es.protocol import SeedRecord
    from es_ray.es.state import replay_request

    members = tuple(ask(6, "antithetic"))
    fitness = tuple(float(z) for z in shape_fitness(np.array([0.1, 0.7, 0.3, 0.3, 0.9, 0.0])))
    record = SeedRecord(7, 1e-3, 5e-4, members, (0.1, 0.7, 0.3, 0.3, 0.9, 0.0), fitness, checksum="abc")
    line = json.loads(json.dumps(record.to_json()))
    assert list(line) == ["iteration", "sigma", "lr", "members", "rewards", "fitness", "checksum"]
    assert line["members"][1] == [members[1].index, members[1].noise_id, members[1].sign]
    assert SeedRecord.from_json(line) == record
    assert replay_request(line) == record.update_request() == UpdateRequest(7, 1e-3, members, fitness, False)
    assert "checksum" not in SeedRecord(0, 1e-3, 0.0, members, (), fitness).to_json()


def test_per_prompt_values_are_scalars_sized_by_members_times_prompts():
    """es.fitness_baseline=per_prompt: a member sends one float per prompt (never a completion or an array), so the
    answer grows as members x prompts scalars, about 9 bytes each pickled."""
    prompts = 16
    rng = np.random.default_rng(1)
    result = EvalResult(
        tuple(
            MemberResult(i, 0.5, 16 * 64, 0, 0.25, tuple(float(v) for v in rng.uniform(size=prompts)))
            for i in range(POPULATION)
        ),
        {"generate": 30.5},
    )
    assert bad_leaves(result) == []
    data = pickle.dumps(result)
    assert len(data) < MAX_BYTES + 12 * POPULATION * prompts, len(data)
    assert pickle.loads(data) == result
