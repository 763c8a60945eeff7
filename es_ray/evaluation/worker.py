"""The es-eval Ray actor and the pieces of work it is given.

The work is cut into chunks (a few problems, their eval.n samples, one seed each, fixed by run.seed, the task and
the chunk number, so results do not depend on how many actors run them). An actor generates, grades (graders run in
its own subprocesses) and, with eval.entropy, computes the token entropy of each completion by a teacher-forced
forward pass (the engine's own where it can score entropy; else a transformers copy of the checkpoint, see
``EvalWorker._scorer``); it returns per-sample scalars.
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from es_ray.evaluation.config import EvalJobConfig
from es_ray.core.config import SamplingConfig, TaskConfig
from es_ray.grading.mathverify import configure_default_pool
from es_ray.grading.sandbox import SandboxLimits
from es_ray.models import resolve_model
from es_ray.runtime.actors import Actor, actor_threads
from es_ray.tasks import load_task, task_class
from es_ray.tasks.base import TaskLoadError
from es_ray.tasks.dataset import DatasetTask

# torch, the engine and the torch-backed metrics are imported inside the worker: es-eval's driver imports EvalWorker
# (the class it starts) without torch.

DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
SCORING_ENGINE = "hf"
"""The engine that scores entropy when the generation engine cannot (``Engine.can_score_entropy``)."""


@dataclass(frozen=True)
class Chunk:
    task: str
    index: int
    problem_ids: tuple[int, ...]
    seed: int


def task_path(cfg: EvalJobConfig, name: str) -> str:
    """eval.paths[name], else <eval.data_dir>/<name>.<jsonl|json|parquet|csv>, else "" (the hub)."""
    if name in cfg.eval.paths:
        return cfg.eval.paths[name]
    if cfg.eval.data_dir:
        for suffix in DATA_SUFFIXES:
            candidate = Path(cfg.eval.data_dir).expanduser() / f"{name}{suffix}"
            if candidate.is_file():
                return str(candidate)
    return ""


def task_config(cfg: EvalJobConfig, name: str) -> TaskConfig:
    path = task_path(cfg, name)
    # Dataset tasks and files are scored whole (eval_size 0 keeps every problem out of the held-out cut);
    # a generated task (countdown without a file) is scored on its generated held-out set.
    generated = not path and not issubclass(task_class(name), DatasetTask)
    return TaskConfig(name=name, path=path, eval_size=TaskConfig.eval_size if generated else 0, answer=cfg.eval.answer)


def in_eval_keys(text: str, name: str) -> str:
    """A task's message in es-eval's keys: es-eval has no task.path (it reads eval.paths.<task> or
    eval.data_dir/<task>.jsonl), so a line telling the user to set task.path names those instead."""
    return (
        text.replace(
            "point task.path= at", f"point eval.paths.{name}= (or eval.data_dir= a folder with {name}.jsonl) at"
        )
        .replace("task.path=", f"eval.paths.{name}=")
        .replace("set task.name= to the task they fit", "list the task they fit in eval.tasks=")
    )


def load_eval_task(cfg: EvalJobConfig, name: str):
    try:
        task = load_task(task_config(cfg, name))
    except TaskLoadError as exc:
        raise TaskLoadError(in_eval_keys(str(exc), name)) from None
    problems = task.eval_problems()
    if cfg.eval.limit:
        problems = problems[: cfg.eval.limit]
    return task, problems


def entropy_temperatures(sampling_temperature: float) -> tuple[float, ...]:
    """(sampling T, 1.0), or (1.0,) when the samples were drawn at T = 1 or greedily (greedy has no sampling
    distribution: its entropy is reported at T = 1 only)."""
    if sampling_temperature > 0 and sampling_temperature != 1.0:
        return (float(sampling_temperature), 1.0)
    return (1.0,)


def plan_chunks(cfg: EvalJobConfig, sizes: dict[str, int]) -> list[Chunk]:
    per_chunk = max(1, (cfg.eval.chunk_size or cfg.engine.batch_size) // cfg.eval.n)
    chunks = []
    for name, size in sizes.items():
        for j, start in enumerate(range(0, size, per_chunk)):
            seed = random.Random(f"{cfg.run.seed}/{name}/{j}/eval").getrandbits(62)
            chunks.append(Chunk(name, j, tuple(range(start, min(size, start + per_chunk))), seed))
    return chunks


class EvalWorker(Actor):
    """Plain class; es-eval wraps it with ``ray.remote`` (or runs it in-process with cluster.num_actors=0)."""

    def __init__(self, cfg: EvalJobConfig, rank: int = 0):
        super().__init__(rank, actor_threads(cfg.engine, cfg.cluster))
        from es_ray.engines.base import make_engine

        self.cfg = cfg
        self.model_dir = resolve_model(cfg.model.path)
        self.engine = make_engine(str(self.model_dir), cfg.engine)
        configure_default_pool(cfg.eval.grader_workers, cfg.eval.math_timeout_s)
        self._tasks: dict[str, tuple] = {}
        self._entropy_engine = None
        self._reference_engine = None

    def _task(self, name: str):
        if name not in self._tasks:
            task, problems = load_eval_task(self.cfg, name)
            if hasattr(task, "sandbox_limits"):
                ev = self.cfg.eval
                task.sandbox_limits = SandboxLimits(
                    wall_s=ev.code_timeout_s, cpu_s=ev.code_timeout_s, memory_mb=ev.code_memory_mb
                )
                task.sandbox_workers = ev.grader_workers
            prompts = [self.engine.apply_chat_template(task.messages(p)) for p in problems]
            self._tasks[name] = (task, problems, prompts)
        return self._tasks[name]

    def _scorer(self):
        """The engine that scores entropy: the generation engine where it can (transformers); else a transformers
        engine on the same checkpoint, engine.dtype and device. vLLM returns a full-vocabulary distribution per
        position only as Python lists (prompt_logprobs=-1), too slow for every evaluated token, so this fallback
        holds a second copy of the weights; eval does not change them, so both copies score the same model."""
        if self._entropy_engine is None:
            if self.engine.can_score_entropy:
                self._entropy_engine = self.engine
            else:
                from es_ray.engines.base import make_engine

                self._entropy_engine = make_engine(
                    str(self.model_dir), dataclasses.replace(self.cfg.engine, name=SCORING_ENGINE)
                )
        return self._entropy_engine

    def run_chunk(self, chunk: Chunk) -> dict:
        from es_ray.metrics.entropy import HIST_EDGES, histogram

        ev = self.cfg.eval
        task, problems, prompts = self._task(chunk.task)
        ids = [i for i in chunk.problem_ids for _ in range(ev.n)]
        sampling = SamplingConfig(max_new_tokens=ev.max_new_tokens, temperature=ev.temperature, top_p=ev.top_p)
        t0 = time.perf_counter()
        completions = self.engine.generate([prompts[i] for i in ids], sampling, chunk.seed)
        t1 = time.perf_counter()
        grades = task.grade_batch([c.text for c in completions], [problems[i] for i in ids])
        t2 = time.perf_counter()
        ent_sum, ent_sum_t1, ent_cnt = [0.0] * len(ids), [0.0] * len(ids), [0] * len(ids)
        ent_sum_full = [0.0] * len(ids)  # at T untruncated, beside the nucleus's when top_p < 1
        hist = np.zeros(len(HIST_EDGES) - 1, dtype=np.int64)
        if ev.entropy:
            # the distribution that was sampled (logits / eval.temperature, its top_p nucleus renormalised when
            # top_p < 1), the untruncated one at that temperature, and the model's own (T = 1)
            temps = entropy_temperatures(ev.temperature)
            nucleus = ev.temperature > 0 and ev.top_p < 1.0
            scorer = self._scorer()
            tok = scorer.tokenizer
            prompt_ids = {i: tok(prompts[i], add_special_tokens=False)["input_ids"] for i in chunk.problem_ids}
            # the generated token ids where the engine reports them; else the text re-tokenised (the same tokens
            # except where the tokenizer does not round-trip, as for random models' output)
            pairs = [
                (prompt_ids[i], list(c.token_ids or tok(c.text, add_special_tokens=False)["input_ids"]))
                for i, c in zip(ids, completions)
            ]
            for j, h in enumerate(scorer.entropies_batch(pairs, temps, top_p=ev.top_p if nucleus else 1.0)):
                h = np.asarray(h, dtype=np.float64).reshape(-1, len(temps) + nucleus)
                sampled = h[:, -1] if nucleus else h[:, 0]
                ent_sum[j], ent_sum_t1[j], ent_cnt[j] = float(sampled.sum()), float(h[:, len(temps) - 1].sum()), len(h)
                ent_sum_full[j] = float(h[:, 0].sum())
                hist += histogram(sampled)
        t3 = time.perf_counter()
        samples = [
            {
                "problem": i,
                "sample": j % ev.n,
                "score": g.score,
                "correct": g.correct,
                "failure": g.failure,
                "answer": g.answer,
                "tokens": c.num_tokens,
                "entropy_sum": s,
                "entropy_sum_t1": s1,
                "entropy_sum_untruncated": full,
                "entropy_tokens": k,
                "checks": task.answer_checks(c.text, problems[i]),
                "text": c.text if ev.save_samples else None,
            }
            for j, (i, c, g, s, s1, full, k) in enumerate(
                zip(ids, completions, grades, ent_sum, ent_sum_t1, ent_sum_full, ent_cnt)
            )
        ]
        kl = self._kl(chunk, prompts) if ev.kl_base else None
        return {
            "task": chunk.task,
            "chunk": chunk.index,
            "samples": samples,
            "entropy_hist": hist.tolist(),
            "kl": kl,
            "seconds": {
                "generate": t1 - t0,
                "grade": t2 - t1,
                "entropy": t3 - t2,
                **({"kl": time.perf_counter() - t3} if kl is not None else {}),
            },
        }

    def _reference(self):
        """eval.kl_base: a transformers engine on the reference model (engine.dtype and device): it samples and both
        models are scored by teacher forcing, whose full-vocabulary logits vLLM does not return."""
        if self._reference_engine is None:
            from es_ray.engines.base import make_engine

            self._reference_engine = make_engine(
                str(resolve_model(self.cfg.eval.kl_reference)),
                dataclasses.replace(self.cfg.engine, name=SCORING_ENGINE),
            )
        return self._reference_engine

    def _kl(self, chunk: Chunk, prompts: list[str]) -> dict:
        """Per-token KL both ways between the reference and this model over eval.kl_samples of the reference's own
        samples per problem of the chunk (seeded from the chunk's seed); per sample its sums and token count."""
        import torch

        from es_ray.metrics.kl import completion_kl_sums

        ev = self.cfg.eval
        ref, tuned = self._reference(), self._scorer()
        ids = [i for i in chunk.problem_ids for _ in range(ev.kl_samples)]
        sampling = SamplingConfig(max_new_tokens=ev.max_new_tokens, temperature=ev.temperature, top_p=ev.top_p)
        seed = random.Random(f"{chunk.seed}/kl").getrandbits(62)
        completions = ref.generate([prompts[i] for i in ids], sampling, seed)
        tok = ref.tokenizer
        sums = []
        with torch.no_grad():
            for i, c in zip(ids, completions):
                p_ids = tok(prompts[i], add_special_tokens=False)["input_ids"]
                c_ids = list(c.token_ids or tok(c.text, add_special_tokens=False)["input_ids"])
                if not c_ids:
                    sums.append({"tokens": 0})
                    continue
                sums.append(
                    completion_kl_sums(
                        completion_logits(ref.model, p_ids, c_ids),
                        completion_logits(tuned.model, p_ids, c_ids),
                        ev.temperature,
                        ev.top_p,
                    )
                )
        return {"problems": ids, "sums": sums}


def completion_logits(model, prompt_ids: list[int], completion_ids: list[int]):
    """[L, V] logits predicting the L completion tokens, by one forward pass over prompt + completion."""
    import torch

    ids = torch.tensor([list(prompt_ids) + list(completion_ids)], device=next(model.parameters()).device)
    return model(input_ids=ids, logits_to_keep=len(completion_ids) + 1).logits[0, :-1]
