"""Split a program's trailing asserts into probes (run with the program) and checks (run apart from it).

The sandbox never lets the program under test decide whether a test passed. A test ``assert f(x) == [1, 2]``
becomes the probe ``f(x)``, evaluated in the program's process and sent back as plain data, and the check
``__probe_0 == [1, 2]``, evaluated in a separate process that has not run the program, over values rebuilt from
that data (exact builtin types: an object whose ``__eq__`` returns True cannot cross). What the program can still
do is report wrong values, which is the same as computing them.

Which parts of a test are probes: every maximal subexpression that uses a name the program defines. Builtins and
the names the task's setup code imports, or the program's plain ``import x``, are the check's own: it re-imports
them cleanly, so a program that rebinds ``math.isclose`` or a builtin changes its own process only (an aliasing
import, ``from operator import truth as set``, binds a program name, not the check's), and so is a
standard-library module a test reads an attribute of (``math.isclose``) whatever the program binds to its name.
A probe inside a comprehension or lambda takes the whole comprehension (its loop variables are local to it); a
comparison inside such a probe is then evaluated by the program's process, the one case where a returned object's
``__eq__`` still matters. An attribute or item of a program's object is probed whole (``Point(1, 2).x``).
"""

from __future__ import annotations

import ast
import builtins
import sys
from dataclasses import dataclass, field

_PROBE = "__probe_%d"
_SCOPED = (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


@dataclass
class Split:
    code: str
    """The program without its trailing asserts (what the program's process runs)."""
    probes: list[str] = field(default_factory=list)
    """Expression sources evaluated after the code, in the program's process."""
    tests: list[dict] = field(default_factory=list)
    """{"source", "expr", "probes"} per test: the check over the probes' values, evaluated apart."""
    imports: list[str] = field(default_factory=list)
    """Every import statement of the program (setup included), replayed by the check."""


def _imported_names(tree: ast.AST, any_form: bool) -> tuple[set[str], list[str]]:
    """Names bound by imports and the statements that bind them. ``any_form`` (the trusted setup code): every
    import; else (the program) only plain ``import x`` / ``import x.y``, which bind a module to its own name: a
    program's ``from operator import truth as set`` must not redefine ``set`` for the check."""
    names, stmts = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and (any_form or not any(a.asname for a in node.names)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and any_form:
            names.update(a.asname or a.name for a in node.names if a.name != "*")
        else:
            continue
        stmts.append(ast.unparse(ast.Module(body=[node], type_ignores=[])))
    return names, stmts


def _free_names(node: ast.AST) -> set[str]:
    loads, bound = set(), set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            (loads if isinstance(sub.ctx, ast.Load) else bound).add(sub.id)
        elif isinstance(sub, ast.arg):
            bound.add(sub.arg)
    return loads - bound


class _Prober(ast.NodeTransformer):
    def __init__(self, trusted: set[str], probes: list[str]):
        self.trusted, self.probes, self.used = trusted, probes, []

    def _is_program(self, node: ast.AST) -> bool:
        return bool(_free_names(node) - self.trusted)

    def _probe(self, node: ast.expr) -> ast.expr:
        self.probes.append(ast.unparse(node))
        self.used.append(len(self.probes) - 1)
        return ast.copy_location(ast.Name(_PROBE % (len(self.probes) - 1), ast.Load()), node)

    def visit(self, node):
        if not isinstance(node, ast.expr) or not self._is_program(node):
            return node if isinstance(node, ast.expr) else self.generic_visit(node)
        if isinstance(node, ast.Name) or isinstance(node, _SCOPED) or isinstance(node, ast.NamedExpr):
            return self._probe(node)
        if isinstance(node, ast.Call) and self._is_program(node.func):
            return self._probe(node)  # the program's own function: its result is the value
        if isinstance(node, (ast.Attribute, ast.Subscript)) and self._is_program(node.value):
            return self._probe(node)  # Point(1, 2).x: the attribute's value crosses, not the program's object
        return self.generic_visit(node)  # comparisons, boolean logic, arithmetic, a trusted call's arguments


def split_tests(program: str, setup: str = "") -> Split:
    """Take the program's trailing top-level asserts apart (see the module docstring). ``setup``: the task's own
    setup code (its imports are the check's in any form). A program that does not parse is returned whole, with no
    tests (it fails on its own)."""
    try:
        tree = ast.parse(program)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return Split(program)
    body = list(tree.body)
    tail: list[ast.Assert] = []
    while body and isinstance(body[-1], ast.Assert):
        tail.insert(0, body.pop())
    if not tail:
        return Split(program)
    try:
        names, imports = _imported_names(ast.parse(setup), True)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        names, imports = set(), []
    more, stmts = _imported_names(ast.Module(body=body, type_ignores=[]), False)
    names, imports = names | more, imports + stmts
    first = tail[0]
    code = ("".join(program.splitlines(keepends=True)[:first.lineno - 1]) if first.col_offset == 0
            else ast.unparse(ast.Module(body=body, type_ignores=[])) + "\n")
    split = Split(code, imports=imports)
    # a standard-library module a test reads an attribute of (math.isclose) is the check's own even when the
    # program binds that name itself (math = <anything with an isclose>): the check imports the real module
    modules = {n.value.id for t in tail for n in ast.walk(t.test) if isinstance(n, ast.Attribute)
               and isinstance(n.value, ast.Name) and n.value.id in sys.stdlib_module_names} - names
    split.imports += [f"import {m}" for m in sorted(modules)]
    prober = _Prober(names | modules | set(dir(builtins)), split.probes)
    for node in tail:
        prober.used, source = [], ast.unparse(node)
        expr = prober.visit(node.test)
        split.tests.append({"source": source, "expr": ast.unparse(expr), "probes": prober.used,
                            "expected": _literal_expected(expr)})
    return split


def _literal_expected(expr: ast.expr) -> str | None:
    """For ``__probe_i == <literal>`` (most MBPP tests) the literal's source: the grader compares that one by value
    itself, with no check process."""
    if not (isinstance(expr, ast.Compare) and len(expr.ops) == 1 and isinstance(expr.ops[0], ast.Eq)
            and isinstance(expr.left, ast.Name) and expr.left.id.startswith("__probe_")):
        return None
    source = ast.unparse(expr.comparators[0])
    try:
        ast.literal_eval(source)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None
    return source
