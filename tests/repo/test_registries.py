"""One registration style (es_ray/core/registry.py): every option list is a table of the objects themselves,
imported; no "module:attr" string names the project's code; the one lazy mechanism, the engines' traits methods
(es_ray/engines/__init__.py), imports only names its modules define; no registry names another module's private
function."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import re
from pathlib import Path

from es_ray.core.registry import Registry
from es_ray.engines import ENGINES, EngineTraits
from es_ray.engines.base import Engine
from paths import REPO

CODE = ("es_ray", "grpo", "launch", "scripts", "benchmarks")
IMPORT_PATH = re.compile(r"^(es_ray|grpo|launch)(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")
"""A string that names the project's code as "module:attr"."""
MAPPED = {"grpo": "es_ray.grpo", "launch": "es_ray.launch"}


def import_path_strings(source: str) -> list[tuple[int, str]]:
    return [
        (node.lineno, node.value)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and IMPORT_PATH.match(node.value)
    ]


def test_no_string_names_the_projects_code():
    sample = 'A = {"x": "es_ray.grpo.loss:_token_mean"}\nB = "package.module:Task"\nC = "es_ray.noise"\n'
    assert import_path_strings(sample) == [(1, "es_ray.grpo.loss:_token_mean")]  # the check can fail
    bad = [
        f"{p.relative_to(REPO)}:{line}: {text}"
        for d in CODE
        for p in sorted((REPO / d).rglob("*.py"))
        for line, text in import_path_strings(p.read_text())
    ]
    assert bad == [], "import the object and put it in the table (es_ray/core/registry.py)"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    parts[0] = MAPPED.get(parts[0], parts[0])
    return ".".join(parts).removesuffix(".__init__")


def registry_tables() -> dict[str, list[str]]:
    """The project modules that build a Registry at their top level, and the names they bind one to."""
    out = {}
    for d in ("es_ray", "grpo", "launch"):
        for p in sorted((REPO / d).rglob("*.py")):
            names = [
                ast.unparse(node.targets[0] if isinstance(node, ast.Assign) else node.target)
                for node in ast.parse(p.read_text()).body
                if isinstance(node, (ast.Assign, ast.AnnAssign))
                and isinstance(node.value, ast.Call)
                and ast.unparse(node.value.func) == "Registry"
            ]
            if names:
                out[module_name(p)] = names
    return out


def registries() -> list[tuple[str, str, Registry]]:
    return [
        (module, attr, getattr(importlib.import_module(module), attr))
        for module, attrs in registry_tables().items()
        for attr in attrs
    ]


def test_every_registry_entry_is_an_object_or_a_description():
    """Each entry is the registered object (a function, a class, an instance) or, in an option list that only
    names values, a one-line description; a function or class of another module is public."""
    found = registries()
    assert len(found) >= 25 and {a for _, a, _ in found} >= {
        "ENGINES",
        "TASKS",
        "LOSS_AGGREGATIONS",
        "ADV_SCALES",
        "SHAPERS",
        "OPTIMIZERS",
        "TRACKERS",
    }
    bad = []
    for module, attr, reg in found:
        assert reg.names(), f"{module}.{attr} is empty"
        for name, entry in reg.items():
            where = f"{module}.{attr}[{name!r}]"
            if isinstance(entry, str):
                if IMPORT_PATH.match(entry) or ":" in entry.split()[0]:
                    bad.append(f"{where} is an import path: {entry}")
                continue
            own = getattr(entry, "__module__", module)
            if getattr(entry, "__name__", "").startswith("_") and own != module:
                bad.append(f"{where} is {own}'s private {entry.__name__}")
    assert bad == []


def test_the_registries_hold_what_their_callers_call():
    from es_ray.grpo.loss_kinds import ADV_SCALES, LOSS_AGGREGATIONS
    from es_ray.runtime.tracking import TRACKERS
    from es_ray.strategy import OPTIMIZERS, SHAPERS
    from es_ray.tasks import TASKS
    from es_ray.tasks.base import Task

    assert all(inspect.isclass(TASKS.get(n)) and issubclass(TASKS.get(n), Task) for n in TASKS)
    assert all(inspect.isclass(TRACKERS.get(n)) for n in TRACKERS)
    for reg, arity in ((SHAPERS, 1), (OPTIMIZERS, 4), (LOSS_AGGREGATIONS, 5), (ADV_SCALES, 3)):
        for n in reg:
            params = [p for p in inspect.signature(reg.get(n)).parameters.values() if p.default is p.empty]
            assert len(params) == arity, (reg.key, n)


def local_imports(cls: type) -> list[tuple[str, str, str]]:
    """(method, module, name) for every ``from module import name`` inside ``cls``'s own methods."""
    tree = ast.parse(inspect.getsource(cls).strip())
    out = []
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef):
            out += [
                (fn.name, node.module, a.name)
                for node in ast.walk(fn)
                if isinstance(node, ast.ImportFrom) and node.module
                for a in node.names
            ]
    return out


def top_level_names(module: str) -> set[str]:
    path = REPO / (module.replace(".", "/") + ".py")
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.ImportFrom):
            names |= {a.asname or a.name for a in node.names}
    return names


def test_every_lazy_engine_reference_resolves():
    """The engines' methods import their module where they run (torch, vLLM): each name they import is defined at
    the top of that module (read from its source, so without importing vLLM), every engine has a ``build``, an
    engine with sleep mode a way to turn it on; and the transformers engine's class imports and is an Engine."""
    assert not local_imports(EngineTraits)
    bad, seen = [], 0
    for name, traits in ENGINES.items():
        cls = type(traits)
        assert cls.build is not EngineTraits.build, f"engine.name={name} has no build"
        assert not traits.sleep_mode or cls.enable_sleep_mode is not EngineTraits.enable_sleep_mode, name
        for method, module, attr in local_imports(cls):
            seen += 1
            if not module.startswith("es_ray.engines.") or attr not in top_level_names(module):
                bad.append(f"{cls.__name__}.{method}: from {module} import {attr}")
    assert seen >= 5 and bad == []
    hf = importlib.import_module("es_ray.engines.hf")
    assert issubclass(hf.HFEngine, Engine)


def test_the_config_reference_lists_every_registrys_values():
    """scripts/config_reference.py reads the option lists from the modules it names: every registry table of the
    project is among them, so docs/config.md lists its values under its key (es.fitness_baseline's were missing)."""
    spec = importlib.util.spec_from_file_location("config_reference", REPO / "scripts" / "config_reference.py")
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)
    listed = reference.registries()
    missing = sorted(f"{module}.{attr} ({reg.key})" for module, attr, reg in registries() if reg.key not in listed)
    assert missing == [], "add its module to REGISTRY_MODULES in scripts/config_reference.py"
