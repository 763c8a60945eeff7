"""The benchmark harnesses' own logic (benchmarks/run_ab.py, benchmarks/startup.py, benchmarks/population.py), without
the runs they time."""

from __future__ import annotations

import os
import sys

import pytest
from paths import REPO

sys.path.insert(0, str(REPO / "benchmarks"))


def test_run_ab_expands_the_vllm_preload_to_the_libraries_vllm_would_preload():
    pytest.importorskip("vllm")
    from run_ab import parse_env

    env = parse_env(["LD_PRELOAD=vllm", "OMP_NUM_THREADS=1", "EMPTY="])
    libs = env["LD_PRELOAD"].split(":")
    assert libs and all(os.path.isfile(lib) for lib in libs)
    assert any("libgomp" in os.path.basename(lib) for lib in libs)  # torch's, as vllm/platforms/cpu.py finds it
    assert env["OMP_NUM_THREADS"] == "1" and env["EMPTY"] == ""


def test_startup_phases_read_off_a_trace_split_the_command_and_count_only_the_work_out_of_the_fixed_cost():
    """A hand-written trace of a driver (pid 1) and one actor (pid 2): every phase is the span the docstring names."""
    from startup import phases

    t = 100.0
    ev = [
        (1, "process", "up", t + 0.5),
        (1, "entry", "begin", t + 0.6),
        (1, "ray_start", "begin", t + 2.0),
        (1, "ray_start", "end", t + 6.0),
        (1, "start_actors", "begin", t + 6.0),
        (2, "process", "up", t + 7.0),
        (2, "actor_init", "begin", t + 8.0),
        (2, "engine_build", "begin", t + 8.5),
        (2, "model_load", "begin", t + 9.0),
        (2, "model_load", "end", t + 10.0),
        (2, "engine_build", "end", t + 12.0),
        (2, "actor_init", "end", t + 13.0),
        (1, "start_actors", "end", t + 13.5),
        (1, "work", "begin", t + 13.5),
        (1, "work", "end", t + 20.0),
        (1, "checkpoint", "begin", t + 20.0),
        (1, "checkpoint", "end", t + 22.0),
        (1, "entry", "end", t + 22.0),
    ]
    got = phases([{"pid": p, "event": e, "edge": g, "t": x} for p, e, g, x in ev], t, t + 25.0)
    assert got["python_s"] == pytest.approx(0.5)
    assert got["ray_start_s"] == pytest.approx(4.0)
    assert got["actor_spawn_s"] == pytest.approx(2.0)  # actors asked for until the first __init__ runs
    assert got["model_load_s"] == pytest.approx(1.0)
    assert got["engine_build_s"] == pytest.approx(2.5)  # make_engine less the model load in it
    assert got["work_s"] == pytest.approx(6.5) and got["checkpoint_s"] == pytest.approx(2.0)
    assert got["shutdown_s"] == pytest.approx(3.0)
    assert got["total_s"] == pytest.approx(25.0) and got["fixed_s"] == pytest.approx(25.0 - 6.5)


def _population_phase(
    tokens: list[int], base_tokens: list[int] | None = None, shares: list[float] = (), cpu_shares: list[float] = ()
) -> dict:
    """One phase's figures as ``population.measure`` returns them (seconds arbitrary)."""
    res = {
        "limit_tok_s": 40.0,
        "limit_s": 10.0,
        "limit_tokens": 400,
        "tok_s": 38.0,
        "fixed_share": 0.01,
        "checksum_s": 0.1,
        "outside_generation": 0.02,
        "tokens": tokens[0],
        "iteration_tokens": tokens,
        "all_tokens": 400,
        **{f"{k}_s": 1.0 for k in ("iteration", "generate", "perturb", "restore", "reward", "update")},
    }
    if base_tokens is not None:
        res.update(
            base_loop_tok_s=39.0,
            base_loop_tokens=base_tokens,
            share_repeats=list(shares),
            iteration_share_repeats=list(shares),
            cpu_share_repeats=list(cpu_shares),
        )
    return res


def test_population_share_is_a_defect_only_when_every_repeat_beats_its_reference():
    from population import share_verdict

    assert share_verdict([1.02, 1.05, 1.11]) == {
        "share": 1.05,
        "low": 1.02,
        "high": 1.11,
        "defect": True,
        "above_within_noise": False,
    }
    noisy = share_verdict([0.99, 1.01, 1.03])  # the median above 100%, a repeat below it: the machine's noise
    assert not noisy["defect"] and noisy["above_within_noise"] and noisy["share"] == 1.01
    quiet = share_verdict([0.95, 0.97, 0.96])
    assert not quiet["defect"] and not quiet["above_within_noise"] and quiet["share"] == 0.96
    assert share_verdict([1.0, 1.0, 1.0])["defect"] is False  # equal to its reference is no defect


def test_population_judges_lowrank_against_its_reference_only_on_the_same_work(capsys):
    from population import collect, report

    full = _population_phase([400, 400, 400])
    same = collect(
        "hf", {"full": full, "lowrank": _population_phase([400] * 3, [400] * 3, [0.97, 0.98, 0.96], [0.95, 0.97, 0.96])}
    )
    assert same["hf_lowrank_same_work"] and not same["hf_lowrank_defect"] and same["hf_lowrank_target_met"]
    assert same["hf_lowrank_cpu_share_of_base_loop"] == 0.96
    assert same["hf_lowrank_cpu_share_of_base_loop_range"] == [0.95, 0.97]

    beaten = collect(
        "hf", {"full": full, "lowrank": _population_phase([400] * 3, [400] * 3, [1.1] * 3, [1.04, 1.08, 1.11])}
    )
    assert beaten["hf_lowrank_defect"] and beaten["hf_lowrank_target_met"] is False
    report(beaten, ["hf"])
    assert "BENCHMARK DEFECT" in capsys.readouterr().out

    noisy = collect(
        "hf", {"full": full, "lowrank": _population_phase([400] * 3, [400] * 3, [1.0] * 3, [0.99, 1.02, 1.01])}
    )
    assert not noisy["hf_lowrank_defect"] and noisy["hf_lowrank_above_within_noise"]
    assert noisy["hf_lowrank_target_met"]

    # --eos: the reference's rows (all the base model) stopped at other steps: its share is printed, never judged
    eos = collect(
        "hf", {"full": full, "lowrank": _population_phase([371, 380, 366], [352, 352, 352], [1.1] * 3, [1.1] * 3)}
    )
    assert eos["hf_lowrank_same_work"] is False
    assert "hf_lowrank_defect" not in eos and "hf_lowrank_target_met" not in eos
    report(eos, ["hf"])
    out = capsys.readouterr().out
    assert "not judged" in out and "n/a (not the same work)" in out and "DEFECT" not in out


def test_population_all_tokens_suppresses_eos_on_each_engine():
    from types import SimpleNamespace

    from population import all_tokens

    hf = SimpleNamespace(name="hf", model=SimpleNamespace(generation_config=SimpleNamespace(min_new_tokens=None)))
    all_tokens(hf, 32)
    assert hf.model.generation_config.min_new_tokens == 32

    def sampling_params(sampling, seed, n):
        return [SimpleNamespace(ignore_eos=False, min_tokens=0, seed=(seed, i)) for i in range(n)]

    vllm = SimpleNamespace(name="vllm", _sampling_params=sampling_params)
    all_tokens(vllm, 16)
    params = vllm._sampling_params(None, 7, 3)
    assert [(p.ignore_eos, p.min_tokens, p.seed) for p in params] == [(True, 16, (7, i)) for i in range(3)]


def test_population_more_repeats_make_a_defect_easier_to_see_not_harder():
    """The defect rule is a sign test at a fixed false-alarm rate: each repeat of a reference doing the same work is
    above 100% by chance at most half the time, so k of n repeats above it happens by chance with the binomial tail;
    requiring every repeat above it would make a real defect vanish as --repeats grows (one noisy repeat vetoes it)."""
    from population import DEFECT_FALSE_ALARM, share_verdict

    assert DEFECT_FALSE_ALARM == 0.125  # at the default 3 repeats: all three above, as before
    assert share_verdict([1.04] * 8 + [0.98])["defect"]  # 8 of 9 above: 10 / 512 by chance
    assert share_verdict([1.04] * 7 + [0.98] * 2)["defect"]  # 7 of 9: 46 / 512
    assert not share_verdict([1.04] * 6 + [0.98] * 3)["defect"]  # 6 of 9: 130 / 512, within the noise
    assert not share_verdict([1.05, 1.05])["defect"]  # two repeats cannot tell a defect from noise (1 / 4)
    assert not share_verdict([1.2])["defect"]
    for n in range(3, 13):  # a share above 100% in all but one repeat never gets less convincing with more repeats
        flagged = [share_verdict([1.03] * (m - 1) + [0.97])["defect"] for m in range(n, 13)]
        assert flagged == sorted(flagged)


def test_population_repeats_alternate_and_pair_each_iteration_with_its_own_reference():
    from population import interleaved, paired_shares

    arms = ["limit", "reference", "iteration"]
    assert [interleaved(arms, r) for r in range(3)] == [arms, arms[::-1], arms]
    # the machine slows 2x then 4x between repeats; each repeat's arms alike: every paired ratio is 80%, while a
    # ratio against another repeat's reference would be off by the drift
    iters = [{"tokens": 80, "generate": g, "iteration": 2 * g, "evaluate_cpu": g} for g in (1.0, 2.0, 4.0)]
    bases = [(g, 100, g) for g in (1.0, 2.0, 4.0)]
    got = paired_shares(iters, bases)
    assert got["share_repeats"] == got["cpu_share_repeats"] == [0.8] * 3
    assert got["iteration_share_repeats"] == [0.4] * 3
    with pytest.raises(ValueError):  # a repeat without its reference is no pair
        paired_shares(iters, bases[:2])


def test_population_refuses_eos_and_no_eos_together():
    import subprocess

    script = REPO / "benchmarks" / "population.py"
    proc = subprocess.run([sys.executable, str(script), "--eos", "--no-eos"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--eos and --no-eos contradict each other" in proc.stderr
