"""math-verify in a worker pool with our own timeout: right answers, any thread, timeouts and crashes counted."""

from __future__ import annotations

import sys
import textwrap
import threading
import time

import pytest

from es_ray.grading.mathverify import MathVerifyPool, gold_latex
from es_ray.grading.result import GraderFailure

CASES = [  # (reference answer as the datasets store it, completion, correct?)
    ("204", "So the answer is \\boxed{204}.", True),
    ("204", "So the answer is \\boxed{205}.", False),
    ("\\frac{14}{3}", "Therefore $x = \\frac{14}{3}$", True),
    ("\\frac{14}{3}", "\\boxed{14/3}", True),
    ("27", "\\boxed{27.0}", True),
    ("0.75", "\\boxed{\\frac{3}{4}}", True),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "\\boxed{(3, \\frac{\\pi}{2})}", True),
    ("\\sqrt{2}", "\\boxed{\\frac{2}{\\sqrt{2}}}", True),
    ("\\text{(C)}", "\\boxed{C}", True),
    ("10", "I do not know.", False),
    ("10", "", False),
]


@pytest.fixture(scope="module")
def pool():
    p = MathVerifyPool(workers=2, timeout_s=20.0)
    yield p
    p.close()


def test_equivalent_answers_are_accepted(pool):
    grades = pool.check([(g, c) for g, c, _ in CASES])
    assert [g.correct for g in grades] == [ok for _, _, ok in CASES]
    assert all(g.failure is None for g in grades)
    assert [g.score for g in grades] == [1.0 if ok else 0.0 for _, _, ok in CASES]


def test_the_parsed_answer_is_the_vote_key(pool):
    grades = pool.check([("14/3", "so x = \\boxed{14/3}"), ("14/3", "$x = \\frac{14}{3}$"), ("1", "nothing")])
    assert grades[0].answer == grades[1].answer == "14/3"
    assert grades[2].answer is None


def test_gold_latex_wraps_plain_answers_only():
    assert gold_latex("204") == "$204$"
    assert gold_latex("$x$") == "$x$"
    assert gold_latex("\\boxed{3}") == "\\boxed{3}"


def test_the_pool_works_off_the_main_thread_where_math_verify_alone_does_not(pool):
    """The failure that gave all-zero scores inside Ray: math-verify's SIGALRM timeout off the main thread."""
    from math_verify import parse, verify

    direct: list = []

    def call_directly():
        try:
            direct.append(verify(parse("$204$"), parse("\\boxed{204}")))
        except Exception as exc:  # math-verify 0.9.0 raises; older versions logged and returned False
            direct.append(exc)

    th = threading.Thread(target=call_directly)
    th.start()
    th.join(60)
    assert direct and direct[0] is not True

    pooled: list = []
    th = threading.Thread(target=lambda: pooled.extend(pool.check([("204", "\\boxed{204}"), ("3", "\\boxed{4}")])))
    th.start()
    th.join(60)
    assert [g.correct for g in pooled] == [True, False]


# A stand-in worker speaking the same protocol, to force hangs, crashes and errors on demand.
FAKE_WORKER = textwrap.dedent("""
    import json, os, sys, time
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if "HANG" in req["pred"]:
            time.sleep(1000)
        if "CRASH" in req["pred"]:
            os._exit(3)
        if "ERR" in req["pred"]:
            print(json.dumps({"id": req["id"], "error": "ValueError: boom"}), flush=True)
            continue
        print(json.dumps({"id": req["id"], "ok": req["pred"] == "good", "answer": req["pred"]}), flush=True)
""")


def test_timeouts_and_crashes_score_zero_are_counted_and_the_pool_recovers():
    pool = MathVerifyPool(workers=2, timeout_s=1.0, command=[sys.executable, "-c", FAKE_WORKER])
    try:
        t0 = time.monotonic()
        grades = pool.check(
            [
                ("x", "good"),
                ("x", "HANG"),
                ("x", "bad"),
                ("x", "CRASH"),
                ("x", "ERR"),
                ("x", "good"),
                ("x", "HANG"),
                ("x", "good"),
            ]
        )
        elapsed = time.monotonic() - t0
        assert [(g.score, g.failure) for g in grades] == [
            (1.0, None),
            (0.0, "timeout"),
            (0.0, None),
            (0.0, "crash"),
            (0.0, "error"),
            (1.0, None),
            (0.0, "timeout"),
            (1.0, None),
        ]
        assert elapsed < 8, elapsed  # two 1 s timeouts run side by side with the rest, plus restarts
        assert pool.restarts == 3
        assert [g.correct for g in pool.check([("x", "good"), ("x", "bad")])] == [True, False]
    finally:
        pool.close()


def test_a_worker_that_cannot_start_is_reported_unavailable():
    pool = MathVerifyPool(
        workers=1, timeout_s=1.0, startup_s=5.0, command=[sys.executable, "-c", "raise SystemExit(1)"]
    )
    assert [g.failure for g in pool.check([("1", "1"), ("2", "2")])] == ["unavailable", "unavailable"]


def test_check_one_raises_a_grader_failure_for_the_trainer(monkeypatch):
    import es_ray.grading.mathverify as mv

    fake = MathVerifyPool(workers=1, timeout_s=0.5, command=[sys.executable, "-c", FAKE_WORKER])
    monkeypatch.setattr(mv, "_default", fake)
    try:
        assert mv.check_one("x", "good").score == 1.0
        with pytest.raises(GraderFailure) as info:
            mv.check_one("x", "HANG")
        assert info.value.kind == "timeout"
    finally:
        fake.close()


def test_an_idle_worker_that_died_is_replaced_without_losing_the_check():
    pool = MathVerifyPool(workers=1, timeout_s=5.0, command=[sys.executable, "-c", FAKE_WORKER])
    try:
        assert pool.check([("x", "good")])[0].correct
        pool._idle[0].proc.kill()  # dies while idle (say, the OOM killer)
        pool._idle[0].proc.wait()
        assert [g.correct for g in pool.check([("x", "good"), ("x", "bad")])] == [True, False]
    finally:
        pool.close()
