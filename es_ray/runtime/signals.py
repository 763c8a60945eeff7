"""SIGTERM (`ray job stop`) and Ctrl-C as an exception raised at safe points of the driver.

The handler only records the signal: an exception raised inside Ray's blocking wait comes out as a SystemError,
so the actor group's wait loop polls ``InterruptGuard.check()`` instead. ``critical()`` marks a stretch that a
signal must not split (ES: an update and its seed-log line; GRPO: an optimizer step and its weight sync). Inside
``step()`` (the run skeleton wraps each step in it) a signal that comes once a critical stretch has begun waits for
the end of the step, so a step the method has committed is always recorded (its metrics row, its ledger entry)
before the run stops; before that, it stops the step at the next wait, and the step is done again on resume.
`ray job stop` sends SIGKILL RAY_JOB_STOP_WAIT_TIME_S after SIGTERM (3 s by default).

The run always ends: the first signal also starts a watchdog that, ``stop_timeout_s`` (faults.stop_timeout_s)
later, ends the process whatever it is doing; once the step running at the signal has returned and the stop path
begins (``rearm``), the stop-time checkpoint gets ``stop_timeout_s`` of its own (one stuck on a lost node included),
so a long step that returns within the grace is saved; a second signal ends it at once. Both shut down the Ray this
driver started (bounded) before ``os._exit``, so no Ray process outlives the driver.
"""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager

# Ray is imported where a forced exit stops it: the guard works without Ray.


class Interrupted(BaseException):
    """SIGTERM or SIGINT reached the driver (a BaseException, like KeyboardInterrupt, so nothing swallows it)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class InterruptGuard:
    """SIGTERM and SIGINT become Interrupted in the main thread at the next ``check()`` outside ``critical()``."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, stop_timeout_s: float = 120.0):
        self._depth, self._pending, self._previous = 0, 0, {}
        self._in_step = self._committed = False
        self._signum = 0
        self.stop_timeout_s = stop_timeout_s
        self._watchdog: threading.Timer | None = None

    def __enter__(self) -> "InterruptGuard":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        if self._watchdog is not None:  # the run ended in time
            self._watchdog.cancel()

    def _handle(self, signum, frame) -> None:
        if self._watchdog is not None:  # the second signal: end now
            force_exit(signum, "a second signal")
        self._pending = self._signum = signum
        self._watchdog = threading.Timer(
            self.stop_timeout_s, force_exit, (signum, f"faults.stop_timeout_s={self.stop_timeout_s:g} s passed")
        )
        self._watchdog.daemon = True
        self._watchdog.start()

    def rearm(self) -> None:
        """The stop path has begun (the step running at the signal returned and is recorded): the stop-time
        checkpoint gets a fresh ``stop_timeout_s``, so a long step that returned within the grace is saved, not cut
        off by what it used of it (a second signal still ends the process at once)."""
        if self._watchdog is None:
            return
        self._watchdog.cancel()
        signum = self._pending or self._signum
        self._watchdog = threading.Timer(
            self.stop_timeout_s,
            force_exit,
            (
                signum,
                f"faults.stop_timeout_s={self.stop_timeout_s:g} s passed while the stop-time checkpoint was written",
            ),
        )
        self._watchdog.daemon = True
        self._watchdog.start()

    def check(self) -> None:
        """Raise Interrupted if a signal came (and we are not inside ``critical()``)."""
        if self._pending and not self._depth and not self._committed:
            signum, self._pending = self._pending, 0
            raise Interrupted(signum)

    @property
    def pending(self) -> bool:
        """A signal came and waits for a safe point."""
        return bool(self._pending)

    @contextmanager
    def critical(self):
        self._depth += 1
        self._committed = self._committed or self._in_step  # from here on the step is the method's commitment
        try:
            yield
        finally:
            self._depth -= 1
        self.check()

    @contextmanager
    def step(self):
        """One step of the run: a signal after its first ``critical()`` began waits until the block ends (the step
        recorded), one before stops it at the next ``check()``."""
        self._in_step, self._committed = True, False
        try:
            yield
        finally:
            self._in_step = self._committed = False
        self.check()


def interrupt_soon(delay_s: float = 0.2) -> None:
    """SIGTERM to this process after ``delay_s`` (as `ray job stop`; the faults group rehearses it)."""
    if threading.current_thread() is not threading.main_thread():  # no handler here: interrupt directly
        raise Interrupted(signal.SIGTERM)
    threading.Timer(delay_s, os.kill, (os.getpid(), signal.SIGTERM)).start()


def force_exit(signum: int, why: str, shutdown_s: float = 10.0) -> None:
    """End this process now with 128 + signum, after shutting down Ray (at most ``shutdown_s``; Ray's own atexit
    hook does not run on ``os._exit``)."""
    print(
        f"stopping now ({why} after {signal.Signals(signum).name}); the last checkpoint and the logs written so far "
        "are what resume starts from",
        flush=True,
    )
    try:
        import ray

        if ray.is_initialized():
            t = threading.Thread(target=ray.shutdown, daemon=True)
            t.start()
            t.join(shutdown_s)
    finally:
        os._exit(128 + signum)
