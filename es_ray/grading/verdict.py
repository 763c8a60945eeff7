"""Split a program's trailing asserts into probes (run with the program) and checks (run apart from it).

The sandbox never lets the program under test decide whether a test passed. A test ``assert f(x) == [1, 2]``
becomes the probe ``f(x)``, evaluated in the program's process and sent back as plain data, and the check
``__probe_0 == [1, 2]``, evaluated in a separate process that has not run the program, over values rebuilt from
that data (exact builtin types: an object whose ``__eq__`` returns True cannot cross). What the program can still
do is report wrong values, which is the same as computing them.

Which parts of a test are probes: every maximal subexpression that uses a name the program defines. Builtins and
the names the task's setup code imports, or the program's plain ``import x``, are the check's own: it re-imports
them cleanly, so a program that rebinds ``math.isclose`` or ``builtins.sorted`` changes its own process only, and
so is a standard-library module a test reads an attribute of (``math.isclose``) whatever the program binds to its
name. No name is trusted over the program's own binding, though: where the program binds a builtin's name that a
test uses (``def max(a, b)``, ``from operator import truth as set``), the test is checked twice, once with the
program's object (probed like any function of the program) and once with the builtin, and must hold both ways;
except the task's own function (``entry``: the names its reference solution defines, ``def sum(n)`` for a digit
sum), which the tests mean as the program's and which is checked with the program's binding only. An attribute or
item of a program's object is probed whole (``Point(1, 2).x``), and so is ``len`` of one (``len(f(250000))``: the
length crosses, not the value; the program reporting a wrong length is the same as computing one).

A test with a comprehension, generator expression or lambda that uses the program's names
(``all(f(x) == y for x, y in pairs)``, ``(lambda: f(1) == 5)()``) is recorded and replayed whole: each maximal
subexpression that uses the program's names is a *site*; the program's process evaluates the test once with
every site's values recorded in order (``__es_site(k, f(x))``), its outcome ignored, and the check evaluates it
again over its own loop values with each site replaced by the next recorded value of that site
(``__es_replay(i, k)``). So
the comparison itself runs in the check: a value whose ``__eq__`` is always True cannot cross, and a check that
needs more values than the program's process recorded fails.
"""

from __future__ import annotations

import ast
import builtins
import copy
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

_PROBE = "__probe_%d"
_SCOPED = (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


@dataclass
class Split:
    code: str
    """The program without its trailing asserts (what the program's process runs)."""
    probes: list = field(default_factory=list)
    """Expression sources evaluated after the code, in the program's process; a comprehension or lambda is
    ``{"record": source, "sites": n}`` (its sites' values are recorded in order)."""
    tests: list[dict] = field(default_factory=list)
    """{"source", "expr", "probes"} per test: the check over the probes' values, evaluated apart."""
    imports: list[str] = field(default_factory=list)
    """Every import statement of the program (setup included), replayed by the check."""
    asserts: int = 0
    """How many trailing asserts the program ends with (a test checked two ways is still one)."""


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


_LINE_END = re.compile(r"\r\n|\r|\n")


def _line_start(text: str, lineno: int) -> int:
    """The offset where line ``lineno`` (1-based, as ``ast`` counts) begins: lines end at ``\\n``, ``\\r\\n`` or
    ``\\r`` only, as the tokenizer splits them (``str.splitlines`` also splits on form feeds, ``\\x1c``-``\\x1e``,
    ``\\x85``, U+2028 and U+2029, which a string literal may hold)."""
    if lineno <= 1:
        return 0
    for k, m in enumerate(_LINE_END.finditer(text), 2):
        if k == lineno:
            return m.end()
    return len(text)


def _bound_names(node: ast.AST) -> set[str]:
    """Names a comprehension or lambda binds for its body (loop targets, parameters)."""
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)} | {
        a.arg for a in ast.walk(node) if isinstance(a, ast.arg)
    }


def _program_bindings(body: list[ast.stmt]) -> set[str]:
    """Every name the program binds anywhere (def, class, assignment, loop, import alias, global): an
    over-approximation of the module names a test may see bound to the program's objects. One walk (linear)."""
    stored, params, names = set(), set(), set()
    for node in ast.walk(ast.Module(body=body, type_ignores=[])):
        if isinstance(node, ast.Name):
            if not isinstance(node.ctx, ast.Load):
                stored.add(node.id)
        elif isinstance(node, ast.arg):
            params.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names if a.name != "*")
        elif isinstance(node, ast.Global):
            names.update(node.names)
    return (stored - params) | names  # a name stored where it is also a parameter is taken as that local


class _Sites(ast.NodeTransformer):
    """Inside a comprehension or lambda: replace each maximal program subexpression by ``make(k, node)``."""

    def __init__(self, trusted: set[str], make, reducers: frozenset = frozenset()):
        self.trusted, self.make, self.n, self.reducers = trusted, make, 0, reducers

    def visit(self, node):
        if not isinstance(node, ast.expr) or not (_free_names(node) - self.trusted):
            return node if isinstance(node, ast.expr) else self.generic_visit(node)
        if isinstance(node, _SCOPED):
            outer, self.trusted = self.trusted, self.trusted | _bound_names(node)
            try:
                return self.generic_visit(node)
            finally:
                self.trusted = outer
        if _whole(node, lambda sub: bool(_free_names(sub) - self.trusted), self.reducers):
            self.n += 1
            return ast.copy_location(self.make(self.n - 1, node), node)
        return self.generic_visit(node)


REDUCERS = frozenset({"len", "bool"})
"""Builtins whose value of a program value is probed whole (its length or truth crosses, not the value), where the
program binds no name of theirs anywhere (else the two-way check reads them)."""


def _whole(node: ast.expr, is_program, reducers: frozenset = frozenset()) -> bool:
    """Whether a program subexpression is taken whole (its value crosses) rather than looked into."""
    return (
        isinstance(node, (ast.Name, ast.NamedExpr))
        # the program's own function: its result (a lambda's call is looked into: its body has the sites)
        or isinstance(node, ast.Call)
        and is_program(node.func)
        and not isinstance(node.func, _SCOPED)
        or isinstance(node, (ast.Attribute, ast.Subscript))
        and is_program(node.value)  # Point(1, 2).x
        # the builtin len (or bool) of a program value: its length crosses, not a value of 250,000 items
        or (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in reducers
            and not is_program(node.func)
            and len(node.args) == 1
            and not node.keywords
            and not isinstance(node.args[0], ast.Starred)
            and not isinstance(node.args[0], _SCOPED)
            and not any(isinstance(sub, _SCOPED) for sub in ast.walk(node.args[0]))
        )
    )


def _call(name: str, *args: ast.expr) -> ast.expr:
    return ast.Call(ast.Name(name, ast.Load()), list(args), [])


class _Prober(ast.NodeTransformer):
    def __init__(self, trusted: set[str], probes: list, reducers: frozenset = frozenset()):
        self.trusted, self.probes, self.used, self.reducers = trusted, probes, [], reducers

    def _is_program(self, node: ast.AST) -> bool:
        return bool(_free_names(node) - self.trusted)

    def _probe(self, node: ast.expr, probe) -> ast.expr:
        self.probes.append(probe)
        self.used.append(len(self.probes) - 1)
        return ast.copy_location(ast.Name(_PROBE % (len(self.probes) - 1), ast.Load()), node)

    def _record(self, node: ast.expr) -> ast.expr:
        """A test with a comprehension or lambda that uses the program: recorded there, replayed in the check."""
        i = len(self.probes)
        rec = _Sites(self.trusted, lambda k, sub: _call("__es_site", ast.Constant(k), sub), self.reducers)
        recorded = rec.visit(copy.deepcopy(node))
        rep = _Sites(self.trusted, lambda k, sub: _call("__es_replay", ast.Constant(i), ast.Constant(k)), self.reducers)
        replayed = rep.visit(copy.deepcopy(node))
        self.probes.append({"record": ast.unparse(recorded), "sites": rec.n})
        self.used.append(i)
        return replayed

    def visit(self, node):
        if not isinstance(node, ast.expr) or not self._is_program(node):
            return node if isinstance(node, ast.expr) else self.generic_visit(node)
        if any(isinstance(sub, _SCOPED) and self._is_program(sub) for sub in ast.walk(node)):
            return self._record(node)  # the whole test: the trusted calls that drive the scope run in both
        if _whole(node, self._is_program, self.reducers):
            return self._probe(node, ast.unparse(node))
        return self.generic_visit(node)  # comparisons, boolean logic, arithmetic, a trusted call's arguments


def task_functions(reference: str) -> tuple[str, ...]:
    """The names a task's reference solution defines at top level that are builtins' names too (MBPP's ``def
    sum(n)``): ``split_tests``'s ``entry``. The reference is the task's, trusted; one that does not parse gives ()."""
    try:
        body = ast.parse(reference).body if isinstance(reference, str) else []
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return ()
    return tuple(
        sorted(
            {n.name for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
            & set(dir(builtins))
        )
    )


class TestsTooLarge(ValueError):
    """The tests cannot be taken apart within the grader's bounds (depth or size): the program fails."""


MAX_TEST_DEPTH = 100
"""Nesting of a test's syntax tree (an addition chain of 100 terms is 100 deep): MBPP's tests stay under 20. The
grader's visitors recurse along it, so a bound set here, not the interpreter's recursion limit (which the host
process may have raised), decides what is too deep to take apart."""
MAX_TEST_NODES = 10_000
"""Syntax nodes in the tests taken apart, over all of them: MBPP's test lists have tens to a few hundred, and
taking 10,000 apart costs the grader seconds (its visitors are Python, one call per node). It matters where the caller
passes no ``n_tests`` (every trailing assert, the candidate's too, is then a test); with it, the tests are the
task's."""


def _depth(node: ast.AST) -> int:
    """The depth of a syntax tree, walked without recursion."""
    deepest, stack = 0, [(node, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
    return deepest


def split_tests(program: str, setup: str = "", n_tests: int | None = None, entry: Sequence[str] = ()) -> Split:
    """Take the program's trailing top-level asserts apart (see the module docstring). ``setup``: the task's own
    setup code (its imports are the check's in any form). ``n_tests``: only the last ``n_tests`` asserts are the
    task's tests; the asserts before them are the candidate's own and stay in its code, run in its process (in the
    check they could rebind what the task's tests use, or write the verdicts). None: every trailing assert is a
    test (the caller vouches for all of them). A program that does not parse is returned whole, with no tests (it
    fails on its own); TestsTooLarge where the tests are too deep or too large to take apart. ``entry``: the task
    function's names (see the module docstring)."""
    try:
        tree = ast.parse(program)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return Split(program)
    body = list(tree.body)
    trailing: list[ast.Assert] = []
    while body and isinstance(body[-1], ast.Assert):
        trailing.append(body.pop())
    trailing.reverse()
    if not trailing:
        return Split(program)
    keep = len(trailing) if n_tests is None else max(0, min(n_tests, len(trailing)))
    body += trailing[: len(trailing) - keep]
    tail = trailing[len(trailing) - keep :]
    if not tail:
        return Split(program, asserts=len(trailing))
    if sum(1 for t in tail for _ in ast.walk(t)) > MAX_TEST_NODES:
        raise TestsTooLarge(f"the tests hold more than {MAX_TEST_NODES} syntax nodes")
    if max(_depth(t) for t in tail) > MAX_TEST_DEPTH:
        raise TestsTooLarge(f"the tests are nested too deep to take apart (more than {MAX_TEST_DEPTH} levels)")
    try:
        return _split(program, setup, body, tail, len(trailing), set(entry))
    except (RecursionError, MemoryError) as exc:  # a test nested deeper than the grader's visitors go
        raise TestsTooLarge(f"the tests are nested too deep to take apart ({type(exc).__name__})") from None


def _split(
    program: str, setup: str, body: list[ast.stmt], tail: list[ast.Assert], asserts: int, entry: set[str]
) -> Split:
    try:
        names, imports = _imported_names(ast.parse(setup), True)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        names, imports = set(), []
    more, stmts = _imported_names(ast.Module(body=body, type_ignores=[]), False)
    names, imports = names | more, imports + stmts
    first = tail[0]
    code = (
        program[: _line_start(program, first.lineno)]
        if first.col_offset == 0
        else ast.unparse(ast.Module(body=body, type_ignores=[])) + "\n"
    )
    split = Split(code, imports=imports, asserts=asserts)
    # a standard-library module a test reads an attribute of (math.isclose) is the check's own even when the
    # program binds that name itself (math = <anything with an isclose>): the check imports the real module
    modules = {
        n.value.id
        for t in tail
        for n in ast.walk(t.test)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in sys.stdlib_module_names
    } - names
    split.imports += [f"import {m}" for m in sorted(modules)]
    trusted = names | modules | set(dir(builtins))
    bindings = _program_bindings(body)
    reducers = REDUCERS - bindings - names
    shadowed = (bindings & set(dir(builtins))) - names
    # the task's function named like a builtin (def sum(n)): the tests mean the program's, as the task's harness runs
    # them; its builtin reading would raise or differ for every correct program
    trusted -= shadowed & entry
    shadowed -= entry
    for node in tail:
        source = ast.unparse(node)
        readings = [trusted]
        if shadowed & _free_names(node.test):  # the program's binding and the builtin: both must hold
            readings.append(trusted - shadowed)
        for reading in readings:
            prober = _Prober(reading, split.probes, reducers)
            expr = prober.visit(_truth(copy.deepcopy(node.test), reading, reducers))
            split.tests.append(
                {
                    "source": source,
                    "expr": ast.unparse(expr),
                    "probes": prober.used,
                    "expected": _literal_expected(expr),
                }
            )
    return split


def _truth(test: ast.expr, trusted: set[str], reducers: frozenset) -> ast.expr:
    """``assert f(x)`` and ``assert not f(x)`` ask only for the truth of the program's value: ``bool(f(x))`` is
    probed whole (its truth crosses, so a value of any type, a ``re.Match``, can be tested; the program reporting a
    wrong truth is the same as computing one). Only where the program binds no ``bool``."""
    if "bool" not in reducers:
        return test

    def is_program(node: ast.AST) -> bool:
        return bool(_free_names(node) - trusted)

    inner = test.operand if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) else test
    if (
        not is_program(inner)
        or not _whole(inner, is_program, reducers)
        or any(isinstance(sub, _SCOPED) for sub in ast.walk(inner))
    ):
        return test
    wrapped = ast.copy_location(_call("bool", inner), inner)
    return ast.copy_location(ast.UnaryOp(ast.Not(), wrapped), test) if inner is not test else wrapped


def _literal_expected(expr: ast.expr) -> str | None:
    """For ``__probe_i == <literal>`` (most MBPP tests) the literal's source: the grader compares that one by value
    itself, with no check process."""
    if not (
        isinstance(expr, ast.Compare)
        and len(expr.ops) == 1
        and isinstance(expr.ops[0], ast.Eq)
        and isinstance(expr.left, ast.Name)
        and expr.left.id.startswith("__probe_")
    ):
        return None
    source = ast.unparse(expr.comparators[0])
    try:
        ast.literal_eval(source)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None
    return source
