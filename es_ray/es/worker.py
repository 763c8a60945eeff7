"""The ES Ray actor: one engine with its fp32 master replica (the engine's ``ReplicaHost``), the task, and nothing
else.

It receives only integers and floats (``EvalRequest`` / ``UpdateRequest``) and returns only scalars. Heavy
imports (torch, transformers, vLLM) happen here, inside the actor process.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict

import numpy as np

from es_ray.es.config import ESTrainConfig, replica_spec
from es_ray.es.faults import FaultInjector
from es_ray.es.protocol import EvalRequest, EvalResult, MemberResult, UpdateRequest, UpdateResult
from es_ray.es.state import load_es_state, save_es_checkpoint, save_es_checkpoint_parts
from es_ray.held_out import held_out_scores
from es_ray.metrics.coverage import prompt_values
from es_ray.models import resolve_model
from es_ray.perturbation import PERTURBATIONS
from es_ray.runtime.actors import Actor, actor_threads, report_progress
from es_ray.runtime.checkpoint import CheckpointError, read_meta
from es_ray.tasks import load_task
from es_ray.tasks.base import score, templated_prompts

# Ray, torch, the engine and the noise are imported inside the actor: the driver imports ESWorker (the class it starts)
# without torch (tests/repo/test_layers.py).


class ESWorker(Actor):
    """Plain class; the driver wraps it with ``ray.remote``. Tests also use it in-process."""

    def __init__(self, cfg: ESTrainConfig, rank: int = 0, immune_through: int = -1):
        """``immune_through``: a replacement started during iteration t ignores injected faults up to t."""
        super().__init__(rank, actor_threads(cfg.engine, cfg.cluster))
        from es_ray.engines.base import make_engine

        self.cfg = cfg
        self.faults = FaultInjector(cfg.faults, rank, immune_through)
        self.model_dir = resolve_model(cfg.model.path)
        self.perturbation = PERTURBATIONS.get(cfg.es.perturbation)
        self.engine = make_engine(
            str(self.model_dir),
            cfg.engine,
            self.perturbation.slots(cfg.es.population, cfg.cluster.num_actors, cfg.es.rank),
        )
        self.replica = self.engine.replica_host()
        self.replica.setup(replica_spec(cfg))
        self.task = load_task(cfg.task)
        self._prompts = templated_prompts(self.engine, self.task)
        self.applied = -1
        """The iteration whose update the replica holds last (-1: the initial weights)."""
        self._last_update: tuple[int, UpdateResult] | None = None

    def ready(self) -> dict:
        """Sizes, and the device the noise is drawn on: its name and SM count ("cpu" and 0 on a CPU; a MIG slice
        names itself and counts its own SMs) and the kind es.noise resolves to there, for the driver's check that
        device-dependent noise runs on one device model."""
        import torch

        from es_ray.noise import resolve_kind

        device = torch.device(getattr(self.engine, "device", "cpu"))
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            name, sm_count = props.name, props.multi_processor_count
        else:
            name, sm_count = device.type, 0
        return {
            **super().ready(),
            "train_size": len(self.task.train),
            "eval_size": len(self.task.eval),
            "skipped_rows": self.task.skipped_rows,
            "skipped_lines": self.task.skipped_lines(),
            "device": name,
            "sm_count": sm_count,
            "noise": resolve_kind(self.cfg.es.noise, device.type, self.cfg.es.noise_scope),
        }

    def _repeat(self, prompt_ids) -> list:
        """Each prompt es.samples_per_prompt times in a row, so one engine call samples them all (rows with equal
        prompts share their prefill)."""
        return [i for i in prompt_ids for _ in range(self.cfg.es.samples_per_prompt)]

    def _member_result(self, index: int, completions, prompt_ids) -> MemberResult:
        problems, es, task = self.task.train, self.cfg.es, self.cfg.task
        rows = self._repeat(prompt_ids)
        rewards, errors = score(self.task, [c.text for c in completions], [problems[i] for i in rows])
        values_p = prompt_values(
            np.asarray(rewards, dtype=np.float64).reshape(len(prompt_ids), -1), task.objective, task.objective_k
        )
        per_prompt = tuple(float(v) for v in values_p) if es.fitness_baseline != "none" else ()
        return MemberResult(
            index,
            sum(rewards) / max(1, len(rows)),
            sum(c.num_tokens for c in completions),
            errors,
            float(values_p.mean()),
            per_prompt,
        )

    def evaluate(self, req: EvalRequest) -> EvalResult:
        self.faults.before_evaluate(req.iteration)
        if self.perturbation.batched:
            return self._evaluate_population(req)
        timing = {"perturb": 0.0, "generate": 0.0, "reward": 0.0, "restore": 0.0}
        results = []
        prompts = [self._prompts["train"][i] for i in self._repeat(req.prompt_ids)]
        for m in req.members:
            if _cancelled():  # the driver was interrupted: stop between members, restore, answer early
                break
            t0 = time.perf_counter()
            self.replica.perturb(req.iteration, m.noise_id, m.sign, req.sigma)
            t1 = time.perf_counter()
            completions = self.engine.generate(prompts, self.cfg.sampling, req.sample_seed)
            t2 = time.perf_counter()
            results.append(self._member_result(m.index, completions, req.prompt_ids))
            timing["perturb"] += t1 - t0
            timing["generate"] += t2 - t1
            timing["reward"] += time.perf_counter() - t2
            if req.report_progress:  # the driver's bar: members done
                report_progress(self.rank, req.iteration, len(results))
            self.faults.member_done(req.iteration, len(results), len(req.members))
        t0 = time.perf_counter()
        self.replica.restore()
        timing["restore"] += time.perf_counter() - t0
        return EvalResult(tuple(results), timing)

    def _evaluate_population(self, req: EvalRequest) -> EvalResult:
        """es.perturbation=lowrank: all of this actor's members in one batched generation (the weights are not
        written: they hold cast(master) throughout)."""
        prompts = [self._prompts["train"][i] for i in self._repeat(req.prompt_ids)]
        t0 = time.perf_counter()
        per_member = self.replica.generate_members(
            req.iteration, list(req.members), req.sigma, prompts, self.cfg.sampling, req.sample_seed
        )
        t1 = time.perf_counter()
        results = []
        for m, completions in zip(req.members, per_member):
            results.append(self._member_result(m.index, completions, req.prompt_ids))
            report_progress(self.rank, req.iteration, len(results))
            self.faults.member_done(req.iteration, len(results), len(req.members))
        timing = {"perturb": 0.0, "generate": t1 - t0, "reward": time.perf_counter() - t1, "restore": 0.0}
        return EvalResult(tuple(results), timing)

    def evaluate_center(self, split: str, seed: int) -> dict:
        """The unperturbed weights on a whole split (the held-out curve: es_ray.held_out)."""
        problems = self.task.eval if split == "eval" else self.task.train
        return held_out_scores(
            self.engine,
            self.task,
            self._prompts[split],
            problems,
            self.cfg.eval,
            self.cfg.sampling.max_new_tokens,
            seed,
        )

    def update(self, req: UpdateRequest) -> UpdateResult:
        """Apply iteration ``req.iteration``'s update; the same request again (re-sent after a transient
        ActorUnavailableError) gets the first answer, never a second update."""
        if self._last_update is not None and self._last_update[0] == req.iteration == self.applied:
            return self._last_update[1]
        t0 = time.perf_counter()
        self.faults.before_update(req.iteration)
        stats = self.replica.update(req.iteration, list(req.members), list(req.fitness), req.sigma)
        self.faults.after_update(req.iteration, self.replica)
        digest = self.replica.checksum() if req.want_checksum else ""
        self.applied = req.iteration
        result = UpdateResult(
            stats["update_norm"], stats["realised_cos"], stats["realised_norm"], digest, time.perf_counter() - t0
        )
        self._last_update = (req.iteration, result)
        return result

    def checksum(self) -> str:
        return self.replica.checksum()

    def save_checkpoint(self, path: str, extra: dict) -> str | dict:
        """The replica as checkpoint ``path`` of iteration ``extra["iteration"]``; ``{"at": i}`` instead when the
        replica holds the weights of iteration i (an update the run did not commit: lost mid-update)."""
        if extra["iteration"] != self.applied + 1:
            return {"at": self.applied + 1}
        meta = {**extra, "checksum": self.replica.checksum(), "engine": asdict(self.cfg.engine)}
        save_parts = getattr(self.replica, "save_parts", None)
        if save_parts is not None:  # the state lives in the engine's worker processes: each writes its own part
            save_es_checkpoint_parts(path, save_parts, self.model_dir, meta)
        else:
            save_es_checkpoint(path, self.replica.state_dict(), self.model_dir, meta)
        return path

    def rebuild(self, checkpoint: str, records: list[UpdateRequest]) -> dict:
        """Load the replica from a checkpoint on disk ('' = the initial weights), then replay the seed-log
        records since it, update by update: the weights never cross the network.

        Returns the master's checksum, the seconds taken, the updates replayed and the model's fp32 size in bytes;
        ``{"unreadable": checkpoint}`` when this node cannot read that checkpoint (no shared disk), so the
        driver can send the whole log instead; ``{"refused": why}`` when a file fails its digest.
        """
        t0 = time.perf_counter()
        source = checkpoint or str(self.model_dir)
        if not os.path.isfile(os.path.join(source, "config.json")):
            return {"unreadable": checkpoint}
        try:
            state = load_es_state(source)  # verified against its digests; tensors read one at a time
        except CheckpointError as exc:  # the driver stops with this one line
            return {"refused": str(exc)}
        model_bytes = state["master"].nbytes()
        self.replica.load_state_dict(state)
        del state
        self.applied = read_meta(checkpoint, "es")["iteration"] - 1 if checkpoint else -1
        self._last_update = None
        for r in records:  # the updates as the driver sent them (SeedRecord.update_request)
            self.replica.update(r.iteration, list(r.members), r.fitness, r.sigma)
            self.applied = r.iteration
        return {
            "checksum": self.replica.checksum(),
            "seconds": time.perf_counter() - t0,
            "replayed": len(records),
            "model_bytes": model_bytes,
        }


def _cancelled() -> bool:
    """True inside a Ray actor task the driver has cancelled (ray.cancel); False outside Ray."""
    try:
        import ray

        return ray.is_initialized() and ray.get_runtime_context().is_canceled()
    except RuntimeError:  # the driver or no task context (in-process use): never cancelled
        return False
