"""es-compare: budgets, the stage plan, the whole pipeline shrunk (tiny model, tiny budgets), and resumption."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from es_ray.es.config import ESConfig
from es_ray.core.config import (
    ClusterConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    RunConfig,
    SamplingConfig,
    TaskConfig,
)
from es_ray.evaluation.config import BenchmarkConfig
from es_ray.launch.compare.run import (
    METHODS,
    BudgetConfig,
    CompareConfig,
    budget_units,
    run,
    stage_plan,
    validate_compare,
)


def _cfg(model_dir: Path, run_dir: Path, **over) -> CompareConfig:
    from es_ray.grpo.config import GRPOConfig, GRPOSamplingConfig

    cfg = CompareConfig(
        model=ModelConfig(path=str(model_dir)),
        # a dense reward the tiny random model can move, so every method's update is non-zero
        task=TaskConfig(name="es_test_tasks:VowelTask", train_size=4, eval_size=4),
        es=ESConfig(population=2, prompts_per_iteration=4, noise="per_tensor", sigma=0.02, lr=4e-4),
        es_sampling=SamplingConfig(max_new_tokens=16),
        grpo=GRPOConfig(prompts_per_step=4, group_size=2, micro_batch_size=8),
        grpo_sampling=GRPOSamplingConfig(max_new_tokens=4),
        budget=BudgetConfig(epochs=2.0),
        eval=BenchmarkConfig(
            tasks=["arithmetic"], n=4, k=[1, 2, 4], max_new_tokens=4, limit=3, entropy=True, grader_workers=1
        ),
        engine=EngineConfig(batch_size=16),
        cluster=ClusterConfig(num_actors=1, cpus_per_actor=1),
        run=RunConfig(dir=str(run_dir), seed=0, trackers=[], progress=False),
    )
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


def test_budget_is_matched_in_prompts_seen():
    assert budget_units(4.0, 16, 16) == 4  # ES: 16 prompts per iteration, pool 16 -> one epoch per iteration
    assert budget_units(4.0, 16, 8) == 8  # GRPO: 8 prompts per step -> two steps per epoch
    assert budget_units(0.1, 16, 16) == 1  # never zero


def test_an_epoch_is_a_pass_over_the_pool_for_both_methods(tmp_path):
    from collections import Counter

    from es_ray.es.driver import prompt_ids
    from es_ray.tasks.base import epoch_prompts
    from es_ray.grpo.driver import prompt_indices

    pool = 10
    for per_step in (3, 5, 10, 25):  # slices crossing epochs' ends; a step larger than the pool
        for steps in range(1, 11):
            counts = Counter(i for step in range(steps) for i in epoch_prompts(pool, per_step, step, seed=7))
            # after e whole epochs every prompt was seen e times; in between, at most once more
            epochs = steps * per_step // pool
            assert set(counts) <= set(range(pool)) and all(epochs <= counts[i] <= epochs + 1 for i in range(pool))
            if steps * per_step % pool == 0:
                assert set(counts.values()) == {epochs}, (per_step, steps, counts)
    assert epoch_prompts(pool, 3, 0, seed=7) != epoch_prompts(pool, 3, 0, seed=8)  # the order is seeded
    cfg = _cfg(Path("/m"), tmp_path)
    cfg.es.prompts_per_iteration = cfg.grpo.prompts_per_step = 3
    es, grpo = _es_train(cfg), _grpo_train(cfg)
    # ES and GRPO with the same prompts per step see the same prompts at every step
    assert all(list(prompt_ids(es, t, pool)) == prompt_indices(grpo, t, pool) for t in range(8))


def _es_train(cfg):
    return stage_plan(cfg, "es", Path(cfg.run.dir), pool=4)[0].config()


def _grpo_train(cfg):
    return stage_plan(cfg, "grpo", Path(cfg.run.dir), pool=4)[0].config()


def test_stage_plan_chains_sequential_halves(tmp_path):
    cfg = _cfg(Path("/models/base"), tmp_path)
    plan = {m: stage_plan(cfg, m, tmp_path, pool=4) for m in METHODS}
    assert [s.name for s in plan["base"]] == ["eval.base"]
    assert [s.name for s in plan["es_grpo"]] == [
        "train.es_grpo.es",
        "train.es_grpo.grpo",
        "eval.es_grpo",
        "drift.es_grpo",
    ]
    es_half, grpo_half = (s.config() for s in plan["es_grpo"][:2])
    full_es = plan["es"][0].config()
    # Each half gets half the budget in prompts seen; the second half starts from the first's final checkpoint.
    assert full_es.es.iterations == 2 and es_half.es.iterations == 1
    assert grpo_half.grpo.steps == 1 and plan["grpo"][0].config().grpo.steps == 2
    assert grpo_half.model.path == str(tmp_path / "stages" / "train.es_grpo.es" / "checkpoints" / "final")
    assert es_half.model.path == "/models/base"
    ev = plan["grpo_es"][2].config()
    assert ev.model.path == str(tmp_path / "stages" / "train.grpo_es.es" / "checkpoints" / "final")
    assert plan["grpo"][0].config().cluster.num_actors == cfg.grpo_rollout_actors


def test_bad_settings_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="methods"):
        validate_compare(_cfg(Path("/m"), tmp_path, methods=["base", "ppo"]))
    with pytest.raises(ConfigError, match="budget.epochs"):
        validate_compare(_cfg(Path("/m"), tmp_path, budget=BudgetConfig(epochs=0)))
    bad = _cfg(Path("/m"), tmp_path)
    bad.grpo.group_size = 1  # a stage's own validation runs before any work
    with pytest.raises(ConfigError, match="group_size"):
        validate_compare(bad)
    with pytest.raises(ConfigError, match=r"seeds=\[\]"):
        validate_compare(_cfg(Path("/m"), tmp_path, seeds=[]))
    with pytest.raises(ConfigError, match=r"seeds=\[1, 1\]"):
        validate_compare(_cfg(Path("/m"), tmp_path, seeds=[1, 1]))
    with pytest.raises(ConfigError, match=r"set seeds=\[3\] instead"):
        validate_compare(_cfg(Path("/m"), tmp_path, run=RunConfig(dir=str(tmp_path), seed=3)))


def test_token_and_device_second_budgets_become_each_runs_stop_and_an_unreachable_one_is_refused(tmp_path):
    cfg = _cfg(Path("/models/base"), tmp_path, budget=BudgetConfig(unit="tokens", epochs=8.0, tokens=60))
    es = stage_plan(cfg, "es", tmp_path, pool=4)[0].config()
    es_half, grpo_half = (s.config() for s in stage_plan(cfg, "es_grpo", tmp_path, pool=4)[:2])
    assert es.run.stop_at_tokens == 60 and es_half.run.stop_at_tokens == grpo_half.run.stop_at_tokens == 30
    assert es.es.iterations == 8 and es.run.stop_at_device_seconds == 0  # the epoch budget is now the cap
    with pytest.raises(
        ConfigError,
        match=r"budget.tokens=10000: es generates 8 completions per iteration at up "
        r"to 16 tokens per completion: about 1,024 tokens within the cap "
        r"budget.epochs=8 \(8 iterations\), below 9,000",
    ):
        validate_compare(_cfg(Path("/m"), tmp_path, budget=BudgetConfig(unit="tokens", epochs=8.0, tokens=10_000)))
    secs = _cfg(Path("/m"), tmp_path, budget=BudgetConfig(unit="device_seconds", device_seconds=30.0))
    assert stage_plan(secs, "grpo", tmp_path, pool=4)[0].config().run.stop_at_device_seconds == 30.0
    with pytest.raises(ConfigError, match="budget.unit='flops' is not one of epochs, tokens, device_seconds"):
        validate_compare(_cfg(Path("/m"), tmp_path, budget=BudgetConfig(unit="flops")))
    with pytest.raises(ConfigError, match="budget.tokens=0"):
        validate_compare(_cfg(Path("/m"), tmp_path, budget=BudgetConfig(unit="tokens")))


def test_a_budget_stops_at_the_step_that_lands_closest_and_device_seconds_keep_start_up_and_checkpoints_apart():
    import time
    from types import SimpleNamespace

    from es_ray.runtime.ledger import Ledger

    def stops(step_tokens: int, budget: int = 100) -> int:
        """Tokens used when the run stops (steps of ``step_tokens``)."""
        led, used = Ledger("es"), 0
        run = SimpleNamespace(stop_at_tokens=budget, stop_at_device_seconds=0)
        while True:
            led.add_step({}, step_tokens)
            used += step_tokens
            if led.stop_reason(run, [], None, used):
                assert "run.stop_at_tokens=100" in led.stopped
                return used

    assert stops(30) == 90  # 90 (10 short) beats 120 (20 past)
    assert stops(45) == 90 and stops(60) == 120 and stops(35) == 105  # the step landing nearer to 100, either side
    assert stops(300) == 300  # one step larger than the budget: the report says "not matched"
    led = Ledger("grpo")
    group = SimpleNamespace(created_at=time.perf_counter())
    time.sleep(0.05)
    led.started()
    with led.apart("checkpoint"):
        time.sleep(0.05)
    time.sleep(0.05)
    held = led._held(group.created_at, time.perf_counter())
    assert held["startup"] >= 0.05 and held["checkpoint"] >= 0.05 and held["training"] >= 0.05
    assert held["startup"] + held["checkpoint"] + held["training"] == pytest.approx(held["total"])


def test_held_out_curves_sample_as_the_evaluation_and_an_empty_held_out_set_is_refused(tmp_path):
    import es_ray.launch.compare.run as compare

    cfg = _cfg(Path("/models/base"), tmp_path)
    for s in (stage_plan(cfg, "es", tmp_path, pool=4)[0], stage_plan(cfg, "grpo", tmp_path, pool=4)[0]):
        ev = s.config().eval
        assert (ev.temperature, ev.top_p, ev.max_new_tokens) == (
            cfg.eval.temperature,
            cfg.eval.top_p,
            cfg.eval.max_new_tokens,
        )
    empty = _cfg(Path("/m"), tmp_path, task=TaskConfig(name="arithmetic", train_size=4, eval_size=0))
    with pytest.raises(ConfigError, match=r"task.eval_size=0 leaves no held-out problems.*curve_every=0"):
        compare.pool_size(empty)
    empty.curve_every = 0
    assert compare.pool_size(empty) == 4
    greedy = _cfg(Path("/m"), tmp_path)
    greedy.eval.temperature, greedy.eval.n, greedy.eval.k = 0.0, 1, [1]
    with pytest.raises(ConfigError, match=r"eval.temperature=0 \(greedy\).*curve_every=0 for no curves"):
        compare.validate_compare(greedy)
    greedy.curve_every = 0
    compare.validate_compare(greedy)  # greedy evaluation without curves is a valid comparison


def test_a_held_out_set_without_problems_scores_none_not_zero():
    from es_ray.core.config import HeldOutConfig
    from es_ray.held_out import held_out_scores

    res = held_out_scores(None, None, [], [], HeldOutConfig(), 8, 0)
    assert res["pass_at_1"] is None and res["reward"] is None and res["tokens"] == 0


def test_every_seed_has_its_own_stages_with_its_own_run_seed(tmp_path):
    cfg = _cfg(Path("/models/base"), tmp_path, seeds=[0, 5])
    s5 = stage_plan(cfg, "es_grpo", tmp_path, pool=4, seed=5)
    assert [s.name for s in s5] == [
        "train.es_grpo.es.s5",
        "train.es_grpo.grpo.s5",
        "eval.es_grpo.s5",
        "drift.es_grpo.s5",
    ]
    assert all(s.config().run.seed == 5 for s in s5[:3])
    assert s5[1].config().model.path == str(tmp_path / "stages" / "train.es_grpo.es.s5" / "checkpoints" / "final")


def _numbers(x, path="report"):
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _numbers(v, f"{path}.{k}")
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _numbers(v, f"{path}[{i}]")
    elif isinstance(x, (int, float)) and not isinstance(x, bool):
        yield path, x


class _Interrupt(Exception):
    pass


def test_pipeline_end_to_end_report_and_resume(ray_local, tiny_model_dir, tmp_path, monkeypatch):
    import es_ray.launch.compare.run as compare

    root = tmp_path / "cmp"
    cfg = validate_compare(_cfg(tiny_model_dir, root))

    # First attempt is cut off when the GRPO->ES comparison reaches its ES half.
    real = compare.run_stage

    def cut(stage, r, log):
        if stage.name == "train.grpo_es.es":
            (stage.dir(r) / "checkpoints").mkdir(parents=True)  # a half-written stage directory
            raise _Interrupt
        return real(stage, r, log)

    monkeypatch.setattr(compare, "run_stage", cut)
    with pytest.raises(_Interrupt):
        run(cfg, log=lambda s: None)
    monkeypatch.setattr(compare, "run_stage", real)
    finished_first = sorted(p.parent.name for p in (root / "stages").glob("*/done.json"))
    assert "train.grpo_es.grpo" in finished_first and "eval.grpo_es" not in finished_first

    lines: list[str] = []
    report = run(cfg, log=lines.append)
    ran = [re.match(r"es-compare: stage \d+/\d+ (\S+): running$", s).group(1) for s in lines if s.endswith(": running")]
    assert ran == ["train.grpo_es.es", "eval.grpo_es", "drift.grpo_es"]  # only what was missing
    assert any("did not finish; starting it again" in s for s in lines)

    for name in [
        "report.md",
        "report.json",
        "reward_curves.png",
        "entropy.png",
        "update_histograms.png",
        "passk_arithmetic.png",
        "training_curves.png",
    ]:
        assert (root / name).is_file() and (root / name).stat().st_size > 0, name
    rep = json.loads((root / "report.json").read_text())
    assert set(rep["methods"]) == set(METHODS)
    bad = [(p, v) for p, v in _numbers(rep) if not math.isfinite(v)]
    assert not bad, bad
    md = (root / "report.md").read_text()
    for table in [t for t in md.split("\n\n") if t.startswith("|")]:  # every row has the header's columns
        widths = {len(re.split(r"(?<!\\)\|", row)) for row in table.splitlines()}
        assert len(widths) == 1, table
    for label in ["Base", "ES", "GRPO", "ES->GRPO", "GRPO->ES"]:
        assert f"| {label} |" in md
    verdict = md[md.index("## Verdict: the paper's effects in this run") :]
    for effect in (
        "coverage at large k",
        "Pass@1 (paper",
        "entropy (paper",
        "L2 distance",
        "functional sparsity",
        "sequential order",
        "compute (left open",
    ):
        assert f"| {effect}" in verdict, effect
    # Measured compute: ES back-propagates nothing, GRPO does; both generated tokens and have a memory peak.
    led = {m: rep["methods"][m]["ledger"] for m in ("es", "grpo")}
    assert led["es"]["tokens_backpropagated"] == 0 and led["grpo"]["tokens_backpropagated"] > 0
    assert led["es"]["tokens_generated"] > 0 and led["grpo"]["peak_rss_bytes_max"] > 0
    assert rep["methods"]["es"]["drift"]["l2"] > 0 and rep["drift_l2_ratio_es_over_grpo"] > 0
    null = rep["methods"]["es"]["drift"]["null"]  # the null model of ES drift, from the ES run's own settings
    assert null["l2"] > 0 and null["steps"] >= 1 and "ES: null model (rewards ignored)" in md
    assert "null" not in rep["methods"]["es_grpo"]["drift"]  # a sequential run is not a pure ES walk
    cast = rep["methods"]["grpo"]["drift"]["cast"]  # the same drift on the weights a bf16 engine holds
    assert cast["dtype"] == "bfloat16" and cast["share_nonzero"] <= rep["methods"]["grpo"]["drift"]["share_nonzero"]
    assert "| GRPO (weights in bfloat16) |" in md
    assert len(rep["methods"]["base"]["passk_curve"]["arithmetic"]) == 4
    for m in ("es", "grpo", "es_grpo"):  # held-out pass@1 and entropy over training, for every trained method
        curve = rep["methods"][m]["held_out_curve"]
        assert curve and all(0 <= p1 <= 1 and ent > 0 for _, p1, ent in curve), (m, curve)
    es_x = [x for x, _, _ in rep["methods"]["es_grpo"]["held_out_curve"]]
    assert es_x == sorted(es_x) and es_x[-1] == pytest.approx(2.0)  # both halves, end to end, up to the budget
    assert es_x[0] == 0
    for m in ("es", "grpo"):  # every curve starts at the base weights, scored before the first step
        base_point = json.loads((root / "stages" / f"train.{m}" / "held_out_base.json").read_text())
        assert rep["methods"][m]["held_out_curve"][0][:2] == [0.0, base_point["pass_at_1"]]
    assert report["run_dir"] == str(root)

    # A repeat after the end trains nothing and evaluates nothing.
    lines.clear()
    run(cfg, log=lines.append)
    assert not [s for s in lines if s.endswith(": running")]

    # The same directory with other settings is refused before any work, naming what changed.
    cfg.eval.n, cfg.eval.k = 8, [1, 8]
    with pytest.raises(ConfigError, match=r"eval.base .*other settings \(eval.k, eval.n\)"):
        run(cfg, log=lines.append)


def test_two_seeds_and_a_token_budget_give_paired_tests_budgets_as_reached_and_the_compute_answer(
    ray_local, tiny_model_dir, tmp_path
):
    root = tmp_path / "seeds"
    budget = BudgetConfig(unit="tokens", epochs=2.0, tokens=40)
    cfg = validate_compare(_cfg(tiny_model_dir, root, methods=["base", "es", "grpo"], seeds=[0, 1], budget=budget))
    lines: list[str] = []
    run(cfg, log=lines.append)
    assert re.fullmatch(r"es-compare: stage 1/14 eval.base.s0: running", lines[0]), lines[0]
    assert lines[-1].startswith(f"es-compare: done; report in {root / 'report.md'}")
    assert any("reachable by every method at the base model's measured" in s for s in lines)
    rep = json.loads((root / "report.json").read_text())
    for stage in ("train.es.s0", "train.grpo.s1"):  # each stopped at the step that lands closest to 40 tokens
        tokens = [
            json.loads(x)["perf/tokens"] for x in (root / "stages" / stage / "metrics.jsonl").read_text().splitlines()
        ]
        used = [sum(tokens[: i + 1]) for i in range(len(tokens))]
        assert all(u + t / 2 < 40 for u, t in zip(used[:-1], tokens[:-1])), (stage, tokens)
        led = json.loads((root / "stages" / stage / "ledger.json").read_text())
        assert (used[-1] + tokens[-1] / 2 >= 40 and "run.stop_at_tokens=40" in led["stop_reason"]) or (
            len(tokens) == 2 and led["stop_reason"] == ""
        ), (stage, tokens, led["stop_reason"])
        apart = led["device_seconds_apart"]
        assert apart["startup"] > 0 and apart["checkpoint"] > 0 and led["device_seconds_training"] > 0
        assert led["device_seconds_training"] + sum(apart.values()) == pytest.approx(led["device_seconds"])
    assert rep["budget"]["unit"] == "tokens"
    assert rep["seeds"] == [0, 1]
    for m in ("base", "es", "grpo"):
        acr = rep["across_seeds"][m]["average"]["4"]
        assert len(acr["values"]) == 2 and acr["std"] >= 0
        assert rep["methods"][m]["average"]["4"] == pytest.approx(sum(acr["values"]) / 2)  # the mean over seeds
        lo, hi = rep["intervals"][m]["average"]["4"]
        assert 0 <= lo <= hi <= 1
    for m in ("es", "grpo"):
        parts = rep["per_seed"]["1"][m]["budget_reached"]["parts"]
        assert len(parts) == 1 and parts[0]["budget"] == 40
        assert parts[0]["matched"] == (abs(parts[0]["used"] / 40 - 1) <= 0.1)
    cmp = rep["comparisons"]
    pairs = {(t["a"], t["b"], t["metric"]) for t in cmp["tests"]}
    assert {
        ("es", "base", "pass@1"),
        ("grpo", "base", "pass@4"),
        ("es", "grpo", "pass@2"),
        ("es", "grpo", "entropy"),
    } <= pairs
    assert len(cmp["tests"]) == 3 * 4 and all(t["p_holm"] >= t["p"] and t["seeds"] == 2 for t in cmp["tests"])
    md = (root / "report.md").read_text()
    assert "## Paired differences (first minus second): exploratory" in md and "Holm at 0.05 over these 3" in md
    assert md.splitlines()[2].startswith("**Primary family** (the paper's claims") and "## Verdict on the" in md
    ver = rep["verdict"]
    assert ver["claims"] == ["pass@max:es>grpo", "entropy:es>grpo", "pass@1:grpo>=es"] and len(ver["tests"]) == 3
    # a claim whose paired differences are all equal (the tiny model gets every Pass@1 wrong) is "not tested" with
    # its reason (es_ray/metrics/verdict.py); the others are checkpoint tests over 2 seeds, Holm over the family
    tested = [t for t in ver["tests"] if "why" not in t]
    assert any(t["metric"] == "entropy" for t in tested)
    assert all(t["level"] == "checkpoint" and t["seeds"] == 2 and t["p_holm"] >= t["p"] for t in tested)
    assert all(t["claim"] == "pass@1:grpo>=es" and "eval.n" in t["why"] for t in ver["tests"] if "why" in t)
    assert all(f"not tested: {t['why']}" in md for t in ver["tests"] if "why" in t)
    assert "Budget as reached (tokens; matched when within +-10% of the budget" in md
    assert "| seed 0 | seed 1 |" in md and "Compute (this run): GRPO's largest peak" in md
    assert (root / "stages" / "eval.es.s1" / "results.json").is_file()

    # report.json keeps the per-problem record (correct counts of eval.n, entropy sums and token counts): the report
    # is rebuilt from the run dir by this code without Ray (rerender), and recomputed from a copied report.json alone
    import shutil

    from es_ray.launch.compare.rerender import rerender

    counts = rep["per_problem"]
    assert counts["n"] == 4 and len(counts["methods"]["es"]["arithmetic"]["correct"]) == 2
    assert all(0 <= c <= 4 for seed in counts["methods"]["grpo"]["arithmetic"]["correct"] for c in seed)
    (root / "report.md").write_text("stale")
    rerender(root)
    again = json.loads((root / "report.json").read_text())
    assert again["verdict"] == rep["verdict"] and again["comparisons"] == rep["comparisons"]
    assert (root / "report.md").read_text().splitlines()[2].startswith("**Primary family**")
    alone = tmp_path / "copied"
    alone.mkdir()
    shutil.copy(root / "report.json", alone / "report.json")
    rerender(alone)
    copied = json.loads((alone / "report.json").read_text())
    assert copied["verdict"] == rep["verdict"] and copied["comparisons"] == rep["comparisons"]


def test_verdicts_name_one_seed_and_exploratory_comparisons():
    """A verdict is never a bare "higher" where the seeds cannot carry a method-level claim, and a comparison outside
    the primary family carries no verdict words (launch/compare/verdict.py; the tests themselves:
    tests/launch/compare/test_verdict.py)."""
    from es_ray.launch.compare.markdown import _difference
    from es_ray.launch.compare.verdict import head_lines, verdict_line

    t = {
        "claim": "pass@16:es>grpo",
        "metric": "pass@16",
        "first": "es",
        "second": "grpo",
        "kind": "superiority",
        "margin": 0.0,
        "seeds": 1,
        "problems": 100,
        "level": "checkpoint",
        "diff": 0.1,
        "se": 0.02,
        "df": 99,
        "p": 1e-5,
        "p_holm": 3e-5,
        "holds": True,
        "lower": 0.07,
        "method": {"diff": 0.1, "low": 0.06, "high": 0.14},
        "checkpoint": {"diff": 0.1, "low": 0.06, "high": 0.14},
    }
    one = verdict_line(t)
    assert one.startswith("holds for this ES run vs this GRPO run") and "no method claim" in one
    three = verdict_line({**t, "seeds": 3})
    assert "these 3 ES runs vs these 3 GRPO runs" in three and "no method claim" in three
    assert verdict_line({**t, "seeds": 5, "level": "method"}) == "holds (method level)"
    assert verdict_line({**t, "seeds": 5, "level": "method", "holds": False}) == "not shown (method level)"
    rep = {
        "verdict": {"tests": [t]},
        "comparisons": {
            "tests": [
                {
                    "a": "es",
                    "b": "grpo",
                    "metric": "pass@1",
                    "diff": 0.01,
                    "low": -0.02,
                    "high": 0.04,
                    "seeds": 1,
                    "seeds_a": 1,
                    "seeds_b": 1,
                }
            ]
        },
    }
    assert _difference(rep, "es", "grpo", 16)[1] == one
    nums, words = _difference(rep, "es", "grpo", 1)
    assert words.startswith("exploratory") and "higher" not in words and "[-2, +4]" in nums
    lines = " ".join(
        head_lines(
            {"seeds": [0], "problems": {"arithmetic": 16}, "verdict": {"claims": ["pass@max:es>grpo"], "alpha": 0.05}}
        )
    )
    assert lines.startswith("**Primary family**") and "pass@max:es>grpo" in lines and "arithmetic 16" in lines
    assert "one seed: checkpoint tests only" in lines and "no method claim" in lines


def test_es_budget_counts_every_sample_per_prompt(tmp_path):
    """Each ES member generates es.samples_per_prompt completions per prompt; the token budget's reach counts them."""
    cfg = _cfg(Path("/m"), tmp_path, budget=BudgetConfig(unit="tokens", epochs=8.0, tokens=10_000))
    cfg.es.samples_per_prompt = 4
    with pytest.raises(
        ConfigError,
        match=r"es generates 32 completions per iteration at up to 16 tokens per "
        r"completion: about 4,096 tokens",
    ):
        validate_compare(cfg)
    cfg.budget.tokens = 4_000  # 2 members x 4 prompts x 4 samples x 16 tokens x 8 iterations = 4,096 reach it
    cfg.methods = ["base", "es"]
    assert stage_plan(validate_compare(cfg), "es", tmp_path, pool=4)[0].config().es.samples_per_prompt == 4


def test_interpolation_stages_join_the_methods_final_weights_and_bad_pairs_are_refused(tmp_path):
    from es_ray.launch.compare.run import InterpolationConfig, interpolation_plan

    cfg = _cfg(
        Path("/models/base"),
        tmp_path,
        seeds=[0, 3],
        methods=["base", "es", "grpo", "es_grpo"],
        interpolate=InterpolationConfig(pairs=["base-es", "es-es_grpo"], grid=[0.0, 0.5, 1.0], draws=50),
    )
    cfg.eval.kl_base = True  # scored along the path without KL (es-interpolate's own refusal is not hit)
    validate_compare(cfg)
    stages = interpolation_plan(cfg, tmp_path, seed=3)
    assert [(s.name, s.kind) for s in stages] == [
        ("interpolate.base-es.s3", "interpolate"),
        ("interpolate.es-es_grpo.s3", "interpolate"),
    ]
    base_es, es_seq = (s.config() for s in stages)
    assert base_es.a == "" and base_es.b == str(tmp_path / "stages" / "train.es.s3" / "checkpoints" / "final")
    assert es_seq.b == str(tmp_path / "stages" / "train.es_grpo.grpo.s3" / "checkpoints" / "final")
    assert base_es.base == "/models/base" and base_es.grid == [0.0, 0.5, 1.0] and base_es.run.seed == 3
    assert base_es.eval.kl_base is False and base_es.eval.n == cfg.eval.n
    for pairs in (["es-ppo"], ["es"], ["es-es"], ["grpo_es-es"]):
        with pytest.raises(ConfigError, match=r"interpolate.pairs: .* is not first-second of two different methods"):
            validate_compare(
                _cfg(
                    Path("/m"),
                    tmp_path,
                    methods=["base", "es", "grpo", "es_grpo"],
                    interpolate=InterpolationConfig(pairs=pairs),
                )
            )
    with pytest.raises(ConfigError, match=r"grid=\[0.5\] must hold distinct values in \[0, 1\], 0 and 1 among"):
        validate_compare(_cfg(Path("/m"), tmp_path, interpolate=InterpolationConfig(pairs=["base-es"], grid=[0.5])))


def _write(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def test_report_shows_objectives_kl_with_intervals_and_the_interpolation_curves(tmp_path):
    """From stage files written here: each training run's objective, the KL table (means over the seeds, intervals
    over problems and seeds, the paired ES - GRPO test) and every path's curves, barrier and cosine."""
    import dataclasses

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from es_ray.metrics.paired import paired_difference, paired_difference_tasks
    from es_ray.launch.compare.analyses import (
        interpolation_figure,
        interpolation_markdown,
        interpolation_section,
        kl_markdown,
        kl_section,
        objectives,
        objectives_markdown,
    )
    from es_ray.launch.compare.plots import title
    from es_ray.launch.compare.run import InterpolationConfig, interpolation_plan

    cfg = _cfg(
        Path("/m"),
        tmp_path,
        methods=["base", "es", "grpo"],
        seeds=[0, 1],
        interpolate=InterpolationConfig(pairs=["es-grpo"], grid=[0.0, 0.5, 1.0]),
    )
    cfg.eval.kl_base, cfg.task.objective, cfg.task.objective_k = True, "pass_at_k", 2
    cfg.es.samples_per_prompt = 2
    plan = {m: {s: stage_plan(cfg, m, tmp_path, pool=4, seed=s) for s in cfg.seeds} for m in cfg.methods}
    rng = np.random.default_rng(1)
    kl = {}  # (method, seed) -> [P] KL(base || tuned)
    for m in cfg.methods:
        for s in cfg.seeds:
            stages = plan[m][s]
            for st in stages:
                if st.kind.startswith("train"):
                    _write(st.dir(tmp_path) / "config.json", dataclasses.asdict(st.config()))
            scale = {"base": 0.0, "es": 0.02, "grpo": 0.005}[m]
            kl[(m, s)] = scale * rng.gamma(2.0, size=5)
            per_problem = {
                str(p): {"base_tuned": float(v), "tuned_base": float(1.5 * v)} for p, v in enumerate(kl[(m, s)])
            }
            ev = next(st for st in stages if st.kind == "eval")
            _write(ev.dir(tmp_path) / "results.json", {"tasks": {"arithmetic": {"kl": {"per_problem": per_problem}}}})
    paths = {s: interpolation_plan(cfg, tmp_path, s) for s in cfg.seeds}
    for s, stages in paths.items():
        curve = [0.5, 0.2 + 0.1 * s, 0.4]
        _write(
            stages[0].dir(tmp_path) / "interpolation.json",
            {
                "grid": [0.0, 0.5, 1.0],
                "updates": {"cosine": 0.01 * s, "by_module_type": {"mlp": 0.02, "norm": None}},
                "tasks": {
                    "arithmetic": {
                        f"pass@{k}": {
                            "curve": curve,
                            "barrier": 0.25 - 0.1 * s,
                            "barrier_at": 0.5,
                            "barrier_interval": [0.1, 0.4],
                            "problems": 3,
                        }
                        for k in cfg.eval.k
                    }
                },
            },
        )

    final = lambda st: next(x for x in st if x.kind == "eval")  # noqa: E731
    rep = {
        "k": cfg.eval.k,
        "tasks": ["arithmetic"],
        "seeds": cfg.seeds,
        "model": "",
        "train_task": "arithmetic",
        "budget": {"unit": "epochs", "epochs": 2.0, "tokens": 0, "device_seconds": 0},
        "methods": {m: {"label": label} for m, label in (("base", "Base"), ("es", "ES"), ("grpo", "GRPO"))},
        "objectives": objectives(tmp_path, {m: plan[m][0] for m in plan}),
        "kl": kl_section(tmp_path, cfg, plan, final),
        "interpolation": interpolation_section(tmp_path, paths),
    }
    assert rep["objectives"]["es"] == [
        {
            "stage": "train.es.s0",
            "part": "es",
            "task": "es_test_tasks:VowelTask",
            "objective": "pass_at_k",
            "k": 2,
            "samples_per_prompt": 2,
        }
    ]
    assert rep["objectives"]["base"] == [] and rep["objectives"]["grpo"][0]["samples_per_prompt"] == 2  # group
    md = "\n".join(objectives_markdown(rep))
    assert "| ES | ES: pass@2 on es_test_tasks:VowelTask (samples per prompt 2) |" in md
    assert "| GRPO | GRPO: pass@2 on es_test_tasks:VowelTask (group size 2) |" in md

    for m in cfg.methods:  # the mean over seeds and problems, with the paired interval against zeros
        x = np.array([kl[(m, s)] for s in cfg.seeds])
        ref = paired_difference(np.zeros_like(x), x)
        cell = rep["kl"]["methods"][m]["arithmetic"]["base_tuned"]
        assert cell["mean"] == pytest.approx(x.mean()) and cell["low"] == pytest.approx(ref.low)
        assert rep["kl"]["methods"][m]["arithmetic"]["tuned_base"]["mean"] == pytest.approx(1.5 * x.mean())
    assert rep["kl"]["methods"]["base"]["arithmetic"]["base_tuned"]["mean"] == 0.0
    test = next(t for t in rep["kl"]["tests"] if t["direction"] == "base_tuned")
    ref = paired_difference_tasks(
        [(np.array([kl[("grpo", s)] for s in cfg.seeds]), np.array([kl[("es", s)] for s in cfg.seeds]))]
    )
    assert (test["a"], test["b"]) == ("es", "grpo") and test["diff"] == pytest.approx(ref.diff)
    assert test["p"] == pytest.approx(ref.p) and test["p_holm"] >= test["p"] and len(rep["kl"]["tests"]) == 2
    md = "\n".join(kl_markdown(rep))
    assert "## Off-task KL to the base model" in md and "| ES - GRPO | base_tuned |" in md
    es_mean = np.mean([kl[("es", s)] for s in cfg.seeds])
    assert f"| ES | KL(base \\|\\| tuned) | {es_mean:.4g} [" in md
    from es_ray.launch.compare.run import tracker_metrics

    tracked = tracker_metrics(
        {
            "methods": {m: {"average": {}, "entropy": {"mean_per_token": None}, "ledger": None} for m in cfg.methods},
            "kl": rep["kl"],
        }
    )
    assert tracked["compare/es/kl_base_tuned"] == pytest.approx(es_mean)
    assert tracked["compare/grpo/kl_tuned_base"] == pytest.approx(1.5 * np.mean([kl[("grpo", s)] for s in cfg.seeds]))

    path = rep["interpolation"]["es-grpo"]
    assert path["grid"] == [0.0, 0.5, 1.0] and set(path["seeds"]) == {"0", "1"}
    assert path["mean_curve"]["arithmetic"]["pass@1"] == pytest.approx([0.5, 0.25, 0.4])
    md = "\n".join(interpolation_markdown(rep))
    assert "### ES -> GRPO" in md and "| 1 | arithmetic | pass@4 | 0.500 | 0.300 | 0.400 | 0.150 [0.100, 0.400]" in md
    assert "| 0 | 0.0000 | 0.0200 | n/a (an update is zero) |" in md  # a zero update's cosine is None: n/a
    fig = interpolation_figure(plt, rep, title)
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert labels == ["ES -> GRPO: pass@1", "ES -> GRPO: pass@4"]
    plt.close(fig)


def test_one_method_has_no_pair_to_test_and_says_so():
    """methods=[base] (or any one method) reaches the report: no paired test, and why (it divided by zero)."""
    from es_ray.launch.compare.report import comparisons

    out = comparisons({"methods": {"base": {}}, "problems": {"arithmetic": [0, 1, 2]}}, [1, 4], ["arithmetic"])
    assert out["tests"] == [] and out["family"] == [] and "one method with samples of every task (base;" in out["why"]
