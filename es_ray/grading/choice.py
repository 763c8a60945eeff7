"""Multiple-choice answers: the letter a completion commits to.

In order of preference, the last of: an explicit "Answer: X" / "answer is (X)" / "\\boxed{X}"; else a letter in
parentheses "(X)"; else a line that is only the letter ("X", "X.", "X)"). Only letters in ``letters`` count, and
only capitals outside parentheses, so "the answer is a ..." or "A cat ..." is not taken for an answer.
"""

from __future__ import annotations

import re


def _patterns(letters: str) -> list[re.Pattern]:
    cls = f"[{re.escape(letters)}]"  # capitals only, except inside parentheses: "the answer is a ..." is no answer
    both = f"[{re.escape(letters)}{re.escape(letters.lower())}]"
    # Linear: every optional piece starts with a non-space token and owns the spaces after it, so no two
    # quantifiers can share a run of spaces (the old "\s*(is)?\s*" backtracked as n^4.7 on "answer" + spaces).
    lead = r"(?i:answer)\s*(?:(?i:is|:)\s*)?(?:(?i:option|choice)\s*)?(?:[:\-]\s*)?(?:\*+\s*)?"
    return [
        re.compile(rf"{lead}(?:\(({both})\)|({cls})(?![\w]))"),
        re.compile(rf"\\boxed\{{\s*(?:\\text\{{\s*)?\(?({both})\)?\s*\}}"),
        re.compile(rf"\(({both})\)"),
        re.compile(rf"^[ \t]*\**\(?({cls})\)?\**[.):]?[ \t]*$", re.M),
    ]


def extract_letter(text: str, letters: str = "ABCD") -> str | None:
    letters = letters.upper()
    for pattern in _patterns(letters):
        found = ["".join(m) if isinstance(m, tuple) else m for m in pattern.findall(text)]
        found = [f.upper() for f in found if f and f.upper() in letters]
        if found:
            return found[-1]
    return None
