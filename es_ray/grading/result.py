"""What a grader returns: a score, whether it counts as correct, the failure kind if grading failed, and the
canonical answer a majority vote is taken over."""

from __future__ import annotations

from dataclasses import dataclass

# Failure kinds, counted per task in es-eval's results (a failure always scores 0):
#   timeout       the grader (math-verify) or the program under test (MBPP) ran past its time limit
#   memory        the program under test ran out of its memory limit
#   output_limit  the program under test wrote more than its output cap
#   escape_attempt the program under test made a system call the sandbox's seccomp filter refuses (a second
#                 process, exec, a socket, ptrace, mount, ...), as the jail's init saw it: it scores 0 however it
#                 looked otherwise
#   too_long      the program under test was over the grader's size cap and was not parsed or run
# (MBPP's kinds come from the jail's own observations, never from the program's exit signal or its output: a
# program that kills itself or prints a mark is an ordinary wrong answer; es_ray/grading/sandbox.py)
#   unparseable_result  the program's reported values could not be parsed, rebuilt or compared within the
#                 grader's size, depth and time bounds (a malformed record, NaN constants, colliding hashes)
#   crash         the grader's worker process died
#   unavailable   the grader could not be started (e.g. math-verify not installed)
#   error         the grader raised (a bug or an input it cannot handle)
FAILURE_KINDS = (
    "timeout",
    "memory",
    "output_limit",
    "escape_attempt",
    "unparseable_result",
    "too_long",
    "crash",
    "unavailable",
    "error",
)


class GraderFailure(RuntimeError):
    """Grading could not decide; the completion scores 0 and the failure is counted under ``kind``."""

    def __init__(self, kind: str, detail: str = ""):
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind
        self.detail = detail


@dataclass(frozen=True)
class Grade:
    score: float
    """The reward (what ES and GRPO optimise)."""
    correct: bool
    """Whether the completion counts as solving the problem (pass@k, maj@k)."""
    failure: str | None = None
    """A kind from FAILURE_KINDS when grading failed (then score is 0), else None."""
    answer: str | None = None
    """The completion's final answer in canonical form, for majority voting (None: no answer or no vote)."""


def failed(kind: str) -> Grade:
    return Grade(0.0, False, kind, None)
