"""Strict math answers: the final ``\\boxed{...}`` of a completion, and whether an answer only restates the problem
(pure: string functions only).

The math tasks' prompts ask for the final answer within \\boxed{} (docs/design.md "A fair comparison": answers
count only as the task's format defines them, boxed for math; a lenient mode is opt-in). ``task.answer=boxed``
(es-eval: ``eval.answer``) grades only that box; ``last`` lets math-verify take the last expression of the completion,
which also scores a completion that merely restates the question ("...we can find 5^3 by cubing" for "Compute $5^3$.").
"""

from __future__ import annotations

import re

from es_ray.core.registry import Registry

ANSWER_MODES = Registry(
    "task.answer",
    {"boxed": "the last \\boxed{...} of the completion", "last": "the last number (or choice) of the completion"},
)
_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_SPACE = re.compile(r"\s+|\\[,;!: ]|\\left|\\right|\$")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}) with balanced braces; None when there is none or the last
    one is cut off (a truncated completion has no final answer)."""
    starts = [m.end() for m in _BOX.finditer(text)]
    if not starts:
        return None
    i, depth = starts[-1], 1
    for j in range(i, len(text)):
        c = text[j]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                content = text[i:j].strip()
                return content or None
    return None


def normalize(expr: str) -> str:
    """Spacing, $ delimiters, \\left/\\right and thin spaces removed: '5 ^ 3' and '$5^3$' compare equal."""
    return _SPACE.sub("", expr)


def restates_problem(answer: str | None, question: str) -> bool:
    """Whether the answer is an expression written in the problem itself, other than a bare number: such an answer
    can be judged equal to the gold one without the model having computed anything ('5^3' for 'Compute $5^3$.')."""
    if not answer:
        return False
    a = normalize(answer)
    if not a or re.fullmatch(r"[-+]?\d+(?:\.\d+)?", a):  # a number that appears in the text may be a real result
        return False
    return a in normalize(question)
