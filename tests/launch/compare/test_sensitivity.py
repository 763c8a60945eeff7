"""es-compare's sensitivity stage (launch/compare/sensitivity.py) without the runs: which short runs a sweep plans,
the refusals, and the summary read back from results on disk (a value whose difference flips sign is said to)."""

from __future__ import annotations

import json

import pytest

from es_ray.core.config import ConfigError
from es_ray.launch.compare import sensitivity
from es_ray.launch.compare.run import stage_plan, to_compare_config


def _cfg(**over):
    base = {
        "methods": ["base", "es", "grpo"],
        "budget": {"epochs": 2.0},
        "seeds": [4, 5],
        "es": {"sigma": 1e-3, "lr": 5e-7},
        "grpo": {"lr": 1e-5},
        "sensitivity": {"grpo": {"lr": [1e-6, 3e-6]}, "es": {"sigma": [2e-3]}},
    }
    for key, value in over.items():
        base[key] = value
    return to_compare_config(base)


def test_a_sweep_plans_one_short_run_per_value_and_the_preset_pair(tmp_path):
    cfg = _cfg()
    planned = sensitivity.plan(cfg, tmp_path, {cfg.task.name: 16}, stage_plan)
    names = [(v.method, v.name, vroot.name) for v, vroot, _ in planned]
    assert names == [
        ("es", "preset", "es.preset"),
        ("grpo", "preset", "grpo.preset"),
        ("grpo", "grpo.lr=1e-06", "grpo.lr=1e-06"),
        ("grpo", "grpo.lr=3e-06", "grpo.lr=3e-06"),
        ("es", "es.sigma=0.002", "es.sigma=0.002"),
    ]
    for v, vroot, stages in planned:
        assert v.cfg.budget.epochs == pytest.approx(0.5) and v.cfg.seeds == [4]  # a quarter of 2 epochs, seed 1
        assert [s.kind for s in stages] == [f"train_{v.method}", "eval", "drift"]
        assert all(s.dir(vroot).parent == vroot / "stages" for s in stages)
    by_name = {v.name: v.cfg for v, _, _ in planned}
    assert by_name["grpo.lr=1e-06"].grpo.lr == 1e-6 and by_name["grpo.lr=1e-06"].es.lr == 5e-7
    sig = by_name["es.sigma=0.002"].es  # the preset's alpha = lr / sigma = 5e-4 kept
    assert sig.sigma == 2e-3 and sig.lr == pytest.approx(1e-6)
    assert sensitivity.plan(_cfg(sensitivity={}), tmp_path, {}, stage_plan) == []


@pytest.mark.parametrize(
    "over, match",
    [
        ({"sensitivity": {"grpo": {"lr": [0.0]}}}, r"^sensitivity.grpo.lr=\[0.0\]: every value must be > 0"),
        ({"sensitivity": {"share": 1.5, "grpo": {"lr": [1e-6]}}}, r"^sensitivity.share=1.5 must be in \(0, 1\]"),
        ({"methods": ["base", "es"]}, r"^sensitivity.\* needs methods to include es and grpo"),
        ({"sensitivity": {"grpo": {"lr": ["abc"]}}}, r"^sensitivity.grpo.lr=\['abc'\]: every value must be a number"),
        ({"sensitivity": {"es": {"sigma": 1e-3}}}, r"^sensitivity.es.sigma=0.001 must be a list"),
        ({"sensitivity": {"es": {"lr": [float("inf")]}}}, r"^sensitivity.es.lr=\[inf\]: every value must be a finite"),
        ({"sensitivity": {"grpo": {"lr": [True]}}}, r"^sensitivity.grpo.lr=\[True\]: every value must be a number"),
        ({"sensitivity": {"grpo": {"lr": [1e-6, 1e-6]}}}, r"^sensitivity.grpo.lr=\[1e-06, 1e-06\] repeats a value"),
        (
            {"methods": ["base", "es"], "sensitivity": {"es": {"sigma": [2e-3]}}},
            r"^sensitivity.\* needs methods to include es and grpo "
            r"\(methods=\['base', 'es'\]; set: sensitivity.es.sigma\)",
        ),
    ],
)
def test_bad_sweeps_are_refused_in_one_line_naming_the_key(over, match):
    with pytest.raises(ConfigError, match=match) as err:
        _cfg(**over)
    assert "\n" not in str(err.value)


def _write(vroot, method, pass1, l2):
    ev = vroot / "stages" / f"eval.{method}"
    ev.mkdir(parents=True)
    (ev / "results.json").write_text(
        json.dumps(
            {
                "tasks": {
                    t: {"pass@k": {"1": pass1, "16": 0.9, "32": 0.95}}
                    for t in ("mbpp", "csqa", "countdown", "aime24", "aime25", "amc23", "math500")
                }
            }
        )
    )
    dr = vroot / "stages" / f"drift.{method}"
    dr.mkdir(parents=True)
    (dr / "drift.json").write_text(json.dumps({"total": {"l2": l2}}))


def test_the_summary_says_where_the_sign_flips_and_states_both_step_sizes(tmp_path):
    cfg = _cfg(seeds=[4])
    planned = sensitivity.plan(cfg, tmp_path, {cfg.task.name: 16}, stage_plan)
    roots = {v.name: vroot for v, vroot, _ in planned}
    _write(tmp_path / "sensitivity" / "es.preset", "es", 0.30, 4.0)
    _write(tmp_path / "sensitivity" / "grpo.preset", "grpo", 0.20, 0.5)
    _write(roots["grpo.lr=1e-06"], "grpo", 0.25, 0.1)  # ES still ahead
    _write(roots["grpo.lr=3e-06"], "grpo", 0.35, 0.3)  # GRPO ahead: the sign flips
    _write(roots["es.sigma=0.002"], "es", 0.28, 8.0)
    report = {"methods": {"es": {"average": {"1": 0.4}}, "grpo": {"average": {"1": 0.3}}}}
    out = sensitivity.summarise(cfg, planned, report)
    rows = {r["name"]: r for r in out["rows"]}
    assert out["main_es_minus_grpo"] == pytest.approx(0.1) and out["preset_pair"]["es_minus_grpo"] == pytest.approx(0.1)
    assert rows["grpo.lr=1e-06"]["es_minus_grpo"] == pytest.approx(0.05) and rows["grpo.lr=1e-06"]["same_sign_as_main"]
    assert rows["grpo.lr=3e-06"]["same_sign_as_preset_pair"] is False and not out["survives"]
    assert rows["grpo.lr=1e-06"]["l2_ratio_es_over_grpo"] == pytest.approx(40.0)  # preset ES 4.0 / this GRPO 0.1
    assert rows["es.sigma=0.002"]["l2_ratio_es_over_grpo"] == pytest.approx(16.0)
    assert rows["grpo.lr=3e-06"]["grpo_step_sizes"]["lr"] == 3e-6
    assert rows["grpo.lr=3e-06"]["es_step_sizes"]["lr"] == 5e-7
    text = "\n".join(sensitivity.markdown(out))
    assert "| grpo.lr=3e-06 | 0.350 | -0.050 | **no** | **no** | 13.33 | 5e-07 / 0.001 | 3e-06 |" in text
    assert "does **not** survive" in text


def test_the_drift_tables_line_names_both_methods_step_sizes():
    text = sensitivity.step_size_text(sensitivity.step_sizes(_cfg(sensitivity={})))
    assert "ES lr 5e-07 with sigma 0.001 (alpha = lr / sigma = 0.0005" in text and "GRPO AdamW lr 1e-05" in text


@pytest.mark.ray
def test_es_compare_runs_the_short_runs_after_the_report_and_appends_their_table(ray_local, tiny_model_dir, tmp_path):
    """The hook in es-compare's run: the main stages, then the preset pair and one GRPO value (share 1.0 here, so
    that the short ES run moves as the main one does);
    sensitivity.json/.md written, the table appended to report.md, and a repeat runs nothing again."""
    from es_ray.core.config import ClusterConfig, EngineConfig, ModelConfig, RunConfig, SamplingConfig, TaskConfig
    from es_ray.es.config import ESConfig
    from es_ray.evaluation.config import BenchmarkConfig
    from es_ray.grpo.config import GRPOConfig, GRPOSamplingConfig
    from es_ray.launch.compare.run import BudgetConfig, CompareConfig, run, validate_compare

    root = tmp_path / "cmp"
    cfg = validate_compare(
        CompareConfig(
            model=ModelConfig(path=str(tiny_model_dir)),
            task=TaskConfig(name="es_test_tasks:VowelTask", train_size=4, eval_size=4),
            es=ESConfig(population=2, prompts_per_iteration=4, noise="per_tensor", sigma=0.02, lr=4e-4),
            es_sampling=SamplingConfig(max_new_tokens=16),  # test_compare.py's: ES's members score apart and it moves
            grpo=GRPOConfig(prompts_per_step=4, group_size=2, micro_batch_size=8),
            grpo_sampling=GRPOSamplingConfig(max_new_tokens=4),
            budget=BudgetConfig(epochs=2.0),
            methods=["es", "grpo"],
            curve_every=0,
            eval=BenchmarkConfig(
                tasks=["arithmetic"], n=2, k=[1, 2], max_new_tokens=4, limit=2, entropy=False, grader_workers=1
            ),
            engine=EngineConfig(batch_size=16),
            cluster=ClusterConfig(num_actors=1, cpus_per_actor=1),
            run=RunConfig(dir=str(root), seed=0, trackers=[], progress=False),
            sensitivity=sensitivity.SensitivityConfig(grpo=sensitivity.GRPOSweep(lr=[1e-3]), share=1.0),
        )
    )
    lines: list[str] = []
    report = run(cfg, log=lines.append)
    ran = [s for s in lines if s.endswith(": running")]
    expected = [
        f"sensitivity {i}/3 {name}"
        for i, name in enumerate(["es preset", "grpo preset", "grpo grpo.lr=0.001"], 1)
        for _ in range(3)
    ]
    assert [s.split(": ")[1] for s in ran if "sensitivity" in s] == expected, ran  # train, eval, drift each
    summary = json.loads((root / "sensitivity.json").read_text())
    assert report["sensitivity"] == summary
    (row,) = summary["rows"]
    assert row["name"] == "grpo.lr=0.001" and row["grpo_step_sizes"]["lr"] == 1e-3 and row["drift_l2"] > 0
    assert row["l2_ratio_es_over_grpo"] > 0 and 0 <= row["pass_at_k"] <= 1
    md = (root / "report.md").read_text()
    assert "## Sensitivity to the step sizes" in md and "| grpo.lr=0.001 |" in md
    assert "Step sizes: ES lr 0.0004 with sigma 0.02" in md  # the drift table's line
    lines.clear()
    run(cfg, log=lines.append)
    assert not [s for s in lines if s.endswith(": running")]
