"""GRPOWorkers starts every actor before waiting on any (the rollout engines load while the learner does), with
the ranks and bundles of one group after the other; a start that fails ends the actors already asked for. Stand-ins
for the runtime's actor groups and placement: no Ray."""

from __future__ import annotations

import pytest

from es_ray.grpo.config import GRPOTrainConfig


def _stand_ins(monkeypatch, events: list, fail_ready: str = ""):
    """Stand-ins that append what they did to ``events``, in order."""
    import es_ray.grpo.driver as driver
    import es_ray.runtime.actors as actors
    import es_ray.runtime.placement as placement

    class Group:
        def __init__(self, role, cls, size, make_args, placement, policy, *, first_bundle=0, **kw):
            self.role, self.cls, self.first_bundle = role, cls, first_bundle
            self.args = [make_args(rank) for rank in range(size)]
            self.ranks = list(range(size))
            events.append(("start", role, [first_bundle + r for r in self.ranks]))

        def __len__(self):
            return len(self.ranks)

        def each(self, method, *args, slow=False):
            events.append(("wait", self.role, method.__name__))
            if self.role == fail_ready:
                raise RuntimeError(f"{self.role} failed to start")
            return [
                {"rank": r, "built": True, "train_size": 8, "trainable": 1, "dtype": "float32", "weight_chunks": 1}
                for r in self.ranks
            ]

        def kill(self):
            events.append(("kill", self.role))

    class Placement:
        def release(self):
            events.append(("release",))

    monkeypatch.setattr(actors, "ActorGroup", Group)
    monkeypatch.setattr(
        placement, "place", lambda cluster, name, count=None: events.append(("place", count)) or Placement()
    )
    monkeypatch.setattr(driver, "check_devices", lambda cfg: None)


class Tracker:
    def message(self, text: str) -> None:
        pass


def _cfg(rollouts: int) -> GRPOTrainConfig:
    cfg = GRPOTrainConfig()
    cfg.cluster.num_actors = rollouts
    return cfg


def test_rollouts_are_asked_for_before_the_learner_is_waited_on(monkeypatch, tmp_path):
    from es_ray.grpo.driver import GRPOWorkers
    from es_ray.grpo.learner import GRPOLearner
    from es_ray.grpo.rollout import RolloutWorker

    events: list = []
    _stand_ins(monkeypatch, events)
    cfg = _cfg(rollouts=3)
    workers = GRPOWorkers(cfg, Tracker(), tmp_path, lambda: None)
    assert events == [
        ("place", 4),
        ("start", "learner", [0]),
        ("start", "rollout", [1, 2, 3]),
        ("wait", "learner", "ready"),
        ("wait", "rollout", "ready"),
    ]
    assert workers.learner.cls is GRPOLearner and workers.learner.args == [(cfg, 0, 1)]
    assert workers.rollouts.cls is RolloutWorker and workers.rollouts.args == [(cfg, 0), (cfg, 1), (cfg, 2)]
    assert [info["rank"] for info in workers.infos] == [0, 1, 2] and workers.learner_info["rank"] == 0


@pytest.mark.parametrize("fails", ["learner", "rollout"])
def test_a_failed_start_ends_every_actor_asked_for_and_the_placement(monkeypatch, tmp_path, fails):
    from es_ray.grpo.driver import GRPOWorkers

    events: list = []
    _stand_ins(monkeypatch, events, fail_ready=fails)
    with pytest.raises(RuntimeError, match=f"{fails} failed"):
        GRPOWorkers(_cfg(rollouts=1), Tracker(), tmp_path, lambda: None)
    assert events[-3:] == [("kill", "learner"), ("kill", "rollout"), ("release",)]
    assert ("start", "rollout", [1]) in events  # asked for before the learner was waited on


def test_colocated_workers_are_one_group(monkeypatch, tmp_path):
    from es_ray.grpo.colocated import ColocatedWorker
    from es_ray.grpo.driver import GRPOWorkers

    events: list = []
    _stand_ins(monkeypatch, events)
    cfg = _cfg(rollouts=2)
    cfg.grpo.colocate = True
    workers = GRPOWorkers(cfg, Tracker(), tmp_path, lambda: None)
    assert events == [("place", 1), ("start", "learner+rollout", [0]), ("wait", "learner+rollout", "ready")]
    assert workers.rollouts is workers.learner and workers.learner.cls is ColocatedWorker
