"""A per-completion time limit for graders: past it, grading raises GraderFailure("timeout") (scored 0, counted).

SIGALRM through an interval timer, so it interrupts pure-Python loops and regular-expression matching alike (the
``re`` engine checks for signals while it matches). Signals reach only the main thread, where Ray runs a
synchronous actor's methods; called from another thread the limit cannot act, and the graders' own bounds hold
(linear patterns, capped inputs, math-verify's and the code sandbox's worker timeouts).
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

from es_ray.grading.result import GraderFailure

GRADE_TIMEOUT_S = 10.0
"""Default limit per completion (a task sets ``grade_timeout_s``; None for graders that hold their own limits)."""


@contextmanager
def time_limit(seconds: float | None):
    if (
        not seconds
        or threading.current_thread() is not threading.main_thread()
        or not hasattr(signal, "setitimer")
        or signal.getitimer(signal.ITIMER_REAL)[0] > 0
    ):  # someone else's alarm is running: leave it alone
        yield
        return

    def expire(signum, frame):
        raise GraderFailure("timeout", f"grading took more than {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
