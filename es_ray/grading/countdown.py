"""Countdown equations, parsed and checked without eval.

The expression is parsed with Python's ``ast`` in ``eval`` mode and walked by hand: only integer literals, the
four operators + - * / and parentheses are accepted (``**``, names, calls and everything else are refused), and
it is evaluated with exact fractions. Input is capped in length, so no expression can be expensive.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from fractions import Fraction

MAX_EXPR_CHARS = 200
_OPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


class ExpressionError(ValueError):
    pass


def _walk(node: ast.AST, numbers: list[int]) -> Fraction:
    if isinstance(node, ast.Expression):
        return _walk(node.body, numbers)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        numbers.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _walk(node.left, numbers), _walk(node.right, numbers)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ExpressionError("division by zero")
        return _OPS[type(node.op)](left, right)
    raise ExpressionError(f"not allowed in an equation: {type(node).__name__}")


def evaluate(expr: str) -> tuple[Fraction, list[int]]:
    """Value of an arithmetic expression and the integers it uses, in order."""
    expr = expr.strip()
    if "=" in expr:  # "3 + 5 * 2 = 13" -> left-hand side
        expr = expr.split("=")[0]
    if not expr or len(expr) > MAX_EXPR_CHARS:
        raise ExpressionError(f"expression empty or longer than {MAX_EXPR_CHARS} characters")
    if not re.fullmatch(r"[\d\s+\-*/()]+", expr):
        raise ExpressionError("only digits, + - * / and parentheses are allowed")
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as exc:
        raise ExpressionError(f"not an expression: {exc.msg}") from exc
    numbers: list[int] = []
    return _walk(tree, numbers), numbers


def _answer_tags(text: str) -> list[str]:
    """What ``<answer>(.*?)</answer>`` finds, by str.find: linear where the regex rescans to the end of the text
    for every unclosed ``<answer>``."""
    found, i = [], 0
    while (start := text.find("<answer>", i)) >= 0:
        end = text.find("</answer>", start + 8)
        if end < 0:
            break
        found.append(text[start + 8 : end])
        i = end + 9
    return found


def extract_equation(completion: str) -> str | None:
    found = _answer_tags(completion)
    if found:
        return found[-1]
    lines = [ln for ln in completion.strip().splitlines() if any(c.isdecimal() for c in ln)]
    return lines[-1] if lines else None


def score(completion: str, nums: list[int], target: int, format_score: float = 0.1) -> float:
    """1 for a correct equation using every number exactly once; ``format_score`` for a well-formed wrong one."""
    eq = extract_equation(completion)
    if eq is None:
        return 0.0
    try:
        value, used = evaluate(eq)
    except ExpressionError:
        return 0.0
    if Counter(used) == Counter(nums) and value == target:
        return 1.0
    return format_score
