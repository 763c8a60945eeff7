"""Math answers checked with math-verify in a pool of worker processes, under our own timeout.

math-verify bounds its parsing and comparison time with SIGALRM, which only works in a process's main thread:
called from a Ray actor's thread it fails on every call (elsewhere that silently gave all-zero scores). Here each
check runs in a separate worker process (its main thread, math-verify's timeouts off), the parent waits at most
``timeout_s`` per check and kills the worker's whole process group when it runs over; the check then scores 0 and
is counted as a ``timeout``, and a fresh worker takes its place. Callable from any thread.
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Sequence

from es_ray.grading.result import Grade, GraderFailure, failed

WORKER_SCRIPT = Path(__file__).with_name("_mathverify_worker.py")
MAX_PRED_CHARS = 4000
"""Only the tail of a completion is parsed: the final answer is at its end, and parse time grows with length."""


def gold_latex(answer: str) -> str:
    """A reference answer as math-verify parses it best: inside $...$ unless it already has delimiters."""
    answer = str(answer).strip()
    return answer if ("$" in answer or "\\boxed" in answer) else f"${answer}$"


class _Worker:
    def __init__(self, command: list[str], startup_s: float):
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True
        )
        self.buf = b""
        os.set_blocking(self.proc.stdout.fileno(), False)
        ready = self.read(time.monotonic() + startup_s)
        if not (isinstance(ready, dict) and ready.get("ready")):
            self.kill()
            raise GraderFailure(
                "unavailable",
                f"math-verify worker did not start ({command[:3]}...); "
                "is math-verify installed (pip install math-verify)?",
            )

    def send(self, obj: dict) -> None:
        self.proc.stdin.write((json.dumps(obj) + "\n").encode())
        self.proc.stdin.flush()

    def read_ready(self) -> dict | None:
        """One reply if a full line is available now; raises EOFError when the worker has died."""
        try:
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
        except BlockingIOError:
            chunk = None
        if chunk == b"":
            if b"\n" not in self.buf:
                raise EOFError
        elif chunk:
            self.buf += chunk
        if b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            return json.loads(line)
        return None

    def read(self, deadline: float) -> dict | None:
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        try:
            while True:
                try:
                    reply = self.read_ready()
                except EOFError:
                    return None
                if reply is not None:
                    return reply
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    if time.monotonic() >= deadline:
                        return None
        finally:
            sel.close()

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        self.proc.wait()


class MathVerifyPool:
    """``check([(gold, completion), ...])`` -> one Grade per pair (score 1/0, the parsed answer for voting)."""

    def __init__(
        self,
        workers: int = 2,
        timeout_s: float = 10.0,
        memory_mb: int = 4096,
        startup_s: float = 120.0,
        command: list[str] | None = None,
    ):
        if workers < 1 or timeout_s <= 0:
            raise ValueError("MathVerifyPool needs workers >= 1 and timeout_s > 0")
        self.size, self.timeout_s, self.startup_s = workers, timeout_s, startup_s
        # -P: the script's own folder (es_ray/grading, with its numbers.py) must not shadow the standard library
        self.command = command or [sys.executable, "-P", str(WORKER_SCRIPT), str(memory_mb)]
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()
        self.restarts = 0

    def _take(self) -> _Worker:
        return self._idle.pop() if self._idle else _Worker(self.command, self.startup_s)

    def check(self, pairs: Sequence[tuple[str, str]]) -> list[Grade]:
        with self._lock:
            return self._check(pairs)

    def _check(self, pairs: Sequence[tuple[str, str]]) -> list[Grade]:
        results: list[Grade | None] = [None] * len(pairs)
        pending = deque(range(len(pairs)))
        busy: dict[_Worker, tuple[int, float]] = {}
        retried: set[int] = set()
        sel = selectors.DefaultSelector()
        try:
            while pending or busy:
                while pending and len(busy) < self.size:
                    i = pending.popleft()
                    t0 = time.monotonic()
                    try:
                        w = self._take()
                    except GraderFailure as exc:
                        results[i] = failed(exc.kind)
                        continue
                    finally:  # starting a worker (seconds) does not count against the others' checks
                        started = time.monotonic() - t0
                        busy.update({b: (j, d + started) for b, (j, d) in busy.items()})
                    gold, pred = pairs[i]
                    try:
                        w.send({"id": i, "gold": gold_latex(gold), "pred": str(pred)[-MAX_PRED_CHARS:]})
                    except OSError:  # an idle worker that died since its last check: once more on a fresh one
                        w.kill()
                        self.restarts += 1
                        if i in retried:
                            results[i] = failed("crash")
                        else:
                            retried.add(i)
                            pending.appendleft(i)
                        continue
                    busy[w] = (i, time.monotonic() + self.timeout_s)
                    sel.register(w.proc.stdout, selectors.EVENT_READ, w)
                if not busy:
                    continue
                wait = max(0.0, min(d for _, d in busy.values()) - time.monotonic())
                ready = {key.data for key, _ in sel.select(wait)}
                now = time.monotonic()
                for w in list(busy):
                    i, deadline = busy[w]
                    reply, dead = None, False
                    if w in ready or now >= deadline:
                        try:
                            reply = w.read_ready()
                        except EOFError:
                            dead = True
                    if reply is None and not dead and now < deadline:
                        continue
                    sel.unregister(w.proc.stdout)
                    del busy[w]
                    if reply is not None:
                        results[i] = _grade(reply)
                        self._idle.append(w)
                    else:  # ran past its time, or died: kill the group, a fresh worker replaces it
                        w.kill()
                        self.restarts += 1
                        results[i] = failed("crash" if dead else "timeout")
        finally:
            sel.close()
            for w in busy:  # only on an exception: never leave a worker mid-request
                w.kill()
        return results  # type: ignore[return-value]

    def close(self) -> None:
        with self._lock:
            for w in self._idle:
                w.kill()
            self._idle.clear()


def _grade(reply: dict) -> Grade:
    if "error" in reply:
        return failed("error")
    ok = bool(reply.get("ok"))
    return Grade(1.0 if ok else 0.0, ok, None, reply.get("answer"))


_default: MathVerifyPool | None = None
_default_lock = threading.Lock()


def default_pool() -> MathVerifyPool:
    """One pool per process (each Ray actor has its own), closed at exit."""
    global _default
    with _default_lock:
        if _default is None:
            workers = int(os.environ.get("ES_RAY_MATH_WORKERS", "2"))
            timeout_s = float(os.environ.get("ES_RAY_MATH_TIMEOUT_S", "10"))
            _default = MathVerifyPool(workers=workers, timeout_s=timeout_s)
            atexit.register(_default.close)
        return _default


def configure_default_pool(workers: int, timeout_s: float) -> MathVerifyPool:
    """Replace the process's pool (es-eval sets eval.grader_workers / eval.math_timeout_s in each actor)."""
    global _default
    with _default_lock:
        if _default is not None:
            _default.close()
        _default = MathVerifyPool(workers=workers, timeout_s=timeout_s)
        atexit.register(_default.close)
        return _default


def close_default_pool() -> None:
    """Close the process's pool (its worker processes end); the next check starts a new one. For a process that
    lives on after an evaluation it ran itself (es-compare's driver)."""
    global _default
    with _default_lock:
        if _default is not None:
            _default.close()
        _default = None


def check_one(gold: str, completion: str) -> Grade:
    """A single check; raises GraderFailure on a timeout or crash (the ES worker counts it as a reward error)."""
    grade = default_pool().check([(gold, completion)])[0]
    if grade.failure:
        raise GraderFailure(grade.failure, "math-verify")
    return grade
