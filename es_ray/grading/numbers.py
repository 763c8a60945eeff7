"""Extract a final number from free-form model output."""

from __future__ import annotations

import re
from fractions import Fraction

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def parse_number(text: str) -> Fraction | None:
    try:
        return Fraction(text.replace(",", "").strip())
    except (ValueError, ZeroDivisionError):
        return None


def final_number(text: str) -> Fraction | None:
    """The answer a completion commits to: after the last '####' or '=' or in a \\boxed{}, else its last number."""
    for marker in ("####", "\\boxed{", "="):
        idx = text.rfind(marker)
        if idx >= 0:
            found = _NUMBER.findall(text[idx + len(marker) :])
            if found:
                return parse_number(found[0])
    found = _NUMBER.findall(text)
    return parse_number(found[-1]) if found else None
