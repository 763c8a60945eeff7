"""es-compare's task sequence (sequence=[...]): the stage plan trains each task in order from the last one's weights
and scores the tasks so far between them; the report's forgetting table and its paired intervals, from stage files
written here (no model, no Ray)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from es_ray.core.config import ClusterConfig, ConfigError, EngineConfig, ModelConfig, RunConfig, TaskConfig
from es_ray.es.config import ESConfig
from es_ray.evaluation.config import BenchmarkConfig
from es_ray.metrics.passk import pass_at_k
from es_ray.metrics.paired import paired_difference
from es_ray.launch.compare.analyses import forgetting_markdown, forgetting_section
from es_ray.launch.compare.run import BudgetConfig, CompareConfig, stage_plan, validate_compare

SEQ = ["arithmetic", "countdown"]


def _cfg(root: Path, **over) -> CompareConfig:
    from es_ray.grpo.config import GRPOConfig

    cfg = CompareConfig(
        model=ModelConfig(path="/models/base"),
        task=TaskConfig(name="arithmetic", train_size=4),
        es=ESConfig(population=2, prompts_per_iteration=4),
        grpo=GRPOConfig(prompts_per_step=2, group_size=2),
        budget=BudgetConfig(epochs=2.0),
        sequence=list(SEQ),
        eval=BenchmarkConfig(tasks=list(SEQ), n=4, k=[1, 4], max_new_tokens=4, limit=3),
        engine=EngineConfig(batch_size=8),
        cluster=ClusterConfig(num_actors=1),
        run=RunConfig(dir=str(root)),
        seeds=[0, 1],
    )
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


def test_each_task_trains_from_the_last_ones_weights_and_the_tasks_so_far_are_scored_between(tmp_path):
    cfg = validate_compare(_cfg(tmp_path))
    es = stage_plan(cfg, "es", tmp_path, pool={"arithmetic": 4, "countdown": 8}, seed=1)
    assert [(s.name, s.kind) for s in es] == [
        ("train.es.arithmetic.s1", "train_es"),
        ("eval.es.after.arithmetic.s1", "seq_eval"),
        ("train.es.countdown.s1", "train_es"),
        ("eval.es.s1", "eval"),
        ("drift.es.s1", "drift"),
    ]
    first, between, second, final = (s.config() for s in es[:4])
    assert first.task.name == "arithmetic" and second.task.name == "countdown"
    assert first.model.path == "/models/base"
    after_first = str(tmp_path / "stages" / "train.es.arithmetic.s1" / "checkpoints" / "final")
    assert between.model.path == second.model.path == after_first
    assert between.eval.tasks == ["arithmetic"] and final.eval.tasks == SEQ  # the tasks so far; then all
    assert final.model.path == str(tmp_path / "stages" / "train.es.countdown.s1" / "checkpoints" / "final")
    # the budget is per task, in epochs over that task's own pool
    assert first.es.iterations == 2 and second.es.iterations == 4 and (es[0].pool, es[2].pool) == (4, 8)
    seq = stage_plan(cfg, "es_grpo", tmp_path, pool=4, seed=0)
    assert [s.name for s in seq] == [
        "train.es_grpo.arithmetic.es.s0",
        "train.es_grpo.arithmetic.grpo.s0",
        "eval.es_grpo.after.arithmetic.s0",
        "train.es_grpo.countdown.es.s0",
        "train.es_grpo.countdown.grpo.s0",
        "eval.es_grpo.s0",
        "drift.es_grpo.s0",
    ]
    assert seq[3].config().model.path.endswith("train.es_grpo.arithmetic.grpo.s0/checkpoints/final")
    assert [s.name for s in stage_plan(cfg, "base", tmp_path, seed=0)] == ["eval.base.s0"]
    # without a sequence the stage names are the one-task ones
    assert [s.name for s in stage_plan(_cfg(tmp_path, sequence=[], seeds=[0]), "es", tmp_path)] == [
        "train.es",
        "eval.es",
        "drift.es",
    ]


@pytest.mark.parametrize(
    "seq, match",
    [
        (["countdown"], r"sequence=\['countdown'\]: give two or more distinct task names"),
        (["arithmetic", "arithmetic"], r"give two or more distinct"),
        (["arithmetic", ""], r"give two or more distinct"),
        (["arithmetic", "gsm8k"], r"\['gsm8k'\] not in eval.tasks=\['arithmetic', 'countdown'\]; .*add them"),
        (["arithmetic", "nope"], r"not in eval.tasks"),
    ],
)
def test_a_bad_sequence_is_refused_in_one_line(tmp_path, seq, match):
    with pytest.raises(ConfigError, match=match) as e:
        validate_compare(_cfg(tmp_path, sequence=seq))
    assert "\n" not in str(e.value)


def _write_samples(path: Path, task: str, correct_pn: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for p, row in enumerate(correct_pn):
            for i, c in enumerate(row):
                f.write(
                    json.dumps({"task": task, "problem": p, "sample": i, "correct": bool(c), "score": float(c)}) + "\n"
                )


def test_forgetting_is_the_change_since_each_task_was_trained_paired_over_problems_and_seeds(tmp_path):
    cfg = _cfg(tmp_path, methods=["base", "es"], seeds=[0, 1, 2])
    plan = {m: {s: stage_plan(cfg, m, tmp_path, pool=4, seed=s) for s in cfg.seeds} for m in cfg.methods}
    rng = np.random.default_rng(0)
    n, problems = 4, 20
    right = {}  # (seed, task, after) -> [P, n] correct
    for s in cfg.seeds:
        for task in SEQ:
            before = rng.random((problems, n)) < 0.3
            right[(s, task, "base")] = before
            _write_samples(plan["base"][s][0].dir(tmp_path) / "samples.jsonl", task, before)
        learned = rng.random((problems, n)) < 0.9  # arithmetic just after it was trained ...
        forgot = learned & (rng.random((problems, n)) < 0.5)  # ... and after countdown: about half of it lost
        right[(s, "arithmetic", 0)], right[(s, "arithmetic", 1)] = learned, forgot
        right[(s, "countdown", 1)] = rng.random((problems, n)) < 0.6
        stages = {st.name.split(".s")[0]: st for st in plan["es"][s]}
        _write_samples(stages["eval.es.after.arithmetic"].dir(tmp_path) / "samples.jsonl", "arithmetic", learned)
        _write_samples(stages["eval.es"].dir(tmp_path) / "samples.jsonl", "arithmetic", forgot)
        _write_samples(stages["eval.es"].dir(tmp_path) / "samples.jsonl", "countdown", right[(s, "countdown", 1)])

    f = forgetting_section(tmp_path, cfg, plan, lambda st: next(x for x in st if x.kind == "eval"))

    def passk(c_pn, k):  # per problem
        return np.array([pass_at_k(n, int(c.sum()), k) for c in c_pn])

    for q, k in enumerate([1, 4]):
        mean_after = [np.mean([passk(right[(s, "arithmetic", i)], k).mean() for s in cfg.seeds]) for i in (0, 1)]
        assert f["methods"]["es"]["arithmetic"]["arithmetic"][q] == pytest.approx(mean_after[0])
        assert f["methods"]["es"]["arithmetic"]["countdown"][q] == pytest.approx(mean_after[1])
        assert f["before"]["countdown"][q] == pytest.approx(
            np.mean([passk(right[(s, "countdown", "base")], k).mean() for s in cfg.seeds])
        )
        d = np.array([passk(right[(s, "arithmetic", 1)], k) - passk(right[(s, "arithmetic", 0)], k) for s in cfg.seeds])
        ref = paired_difference(np.zeros_like(d), d)
        t = next(t for t in f["tests"] if t["method"] == "es" and t["task"] == "arithmetic" and t["k"] == k)
        assert t["mean"] == pytest.approx(d.mean()) == pytest.approx(mean_after[1] - mean_after[0])
        assert (t["low"], t["high"], t["seeds"]) == (pytest.approx(ref.low), pytest.approx(ref.high), 3)
        assert t["p_holm"] >= t["p"]
    assert len(f["tests"]) == 2  # arithmetic at k = 1 and 4; the last task has no later stage to lose it in
    assert f["tests"][0]["mean"] < 0 and f["tests"][0]["high"] < 0  # half of arithmetic lost: separable
    md = "\n".join(forgetting_markdown({"forgetting": f}))
    assert "## Task sequence: arithmetic -> countdown (forgetting)" in md
    assert "| ES | arithmetic |" in md and "| ES | countdown | " in md and "| after countdown |" in md


def test_each_task_of_a_sequence_is_held_to_the_whole_budget(tmp_path):
    """A sequence's training runs each stop at the whole token budget (half per part of a sequential method), and the
    report holds each to that, not to the budget divided over the tasks."""
    from es_ray.launch.compare.report import collect_seed

    cfg = _cfg(
        tmp_path, methods=["es", "es_grpo"], seeds=[0], budget=BudgetConfig(unit="tokens", epochs=8.0, tokens=200)
    )
    plan = {m: stage_plan(cfg, m, tmp_path, pool=4) for m in cfg.methods}
    assert [s.config().run.stop_at_tokens for s in plan["es"] if s.kind.startswith("train")] == [200, 200]
    assert [s.config().run.stop_at_tokens for s in plan["es_grpo"] if s.kind.startswith("train")] == [100] * 4
    for m, stages in plan.items():
        for s in stages:
            if s.kind.startswith("train"):
                _ledger(s.dir(tmp_path), 200 if m == "es" else 100)
            elif s.kind == "eval":
                (s.dir(tmp_path)).mkdir(parents=True)
                (s.dir(tmp_path) / "results.json").write_text(
                    json.dumps(
                        {
                            "model_dir": "/m",
                            "tasks": {t: {"pass@k": {"1": 0.0, "4": 0.0}, "mean_reward": 0.0} for t in SEQ},
                        }
                    )
                )
    rep = collect_seed(tmp_path, cfg, plan, 4)  # no drift.json: drift is left out
    for m, budget in (("es", 200), ("es_grpo", 100)):
        parts = rep["methods"][m]["budget_reached"]["parts"]
        assert [p["budget"] for p in parts] == [budget] * len(parts) and all(p["matched"] for p in parts), parts


def _ledger(run_dir: Path, tokens: int) -> None:
    run_dir.mkdir(parents=True)
    (run_dir / "ledger.json").write_text(
        json.dumps(
            {
                "tokens_generated": tokens,
                "tokens_backpropagated": 0,
                "wall_s": 1.0,
                "startup_s": 0.0,
                "device_seconds": 1.0,
                "device_kind": "cpu",
                "peak_rss_bytes_max": 1,
                "phase_seconds": {},
                "steps": 1,
                "stop_reason": "budget",
                "finished": True,
            }
        )
    )
