"""What each config key does: the docstring written under its dataclass field (the schema is the documentation).
Read by `--help` (es_ray.runtime.entry) and by scripts/config_reference.py, which builds docs/config.md, so the two
say the same."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap


@functools.cache
def field_docs(cls) -> dict[str, str]:
    """The docstring under each field of ``cls`` and its dataclass bases (a string statement after the field), as
    one line each."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for node, after in zip(body, body[1:] + [None]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return docs
