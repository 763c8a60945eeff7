"""The layering, kept by CI: every import of the project's own modules (function-local ones included, only
``if TYPE_CHECKING:`` blocks exempt) points down the layers of README "Architecture" (docs/architecture.md), the
methods never import each other (only the comparison above them imports both), and no two modules import each
other, directly or around a circle."""

from __future__ import annotations

import ast
from pathlib import Path

from paths import REPO

PACKAGES = ("es_ray", "grpo", "launch")
"""The repository folders of the one installed package: es_ray, and grpo/ and launch/ as es_ray.grpo and
es_ray.launch (setup.py's package_dir)."""
MAPPED = {"grpo": "es_ray.grpo", "launch": "es_ray.launch"}
LAYERS = {
    "es_ray.launch": 7,  # the comparison and es-submit: above every method
    "es_ray.es": 6,
    "es_ray.grpo": 6,
    "es_ray.evaluation": 6,  # the methods (and the evaluation jobs)
    "es_ray.runtime": 5,
    "es_ray.held_out": 5,  # one runtime under every method
    "es_ray.engines": 4,
    "es_ray.replica": 4,
    "es_ray.replica_spec": 4,
    "es_ray.memory_plan": 4,
    "es_ray.tasks": 3,
    "es_ray.grading": 3,
    "es_ray.models": 3,
    # pure math
    "es_ray.noise": 2,
    "es_ray.noise_kinds": 2,
    "es_ray.strategy": 2,
    "es_ray.perturbation": 2,
    "es_ray.lowrank": 2,
    "es_ray.metrics": 2,
    "es_ray.grpo.loss": 2,
    "es_ray.grpo.loss_kinds": 2,
    # what each part allocates, stated without torch (es_ray/memory_plan/ sums them)
    "es_ray.model_shape": 2,
    "es_ray.replica_memory": 2,
    "es_ray.engine_memory": 2,
    "es_ray.grpo.learner_memory": 2,
    "es_ray.core": 1,  # imports nothing of the project but itself
}
METHODS = ("es_ray.es", "es_ray.grpo", "es_ray.evaluation")


def group_of(module: str) -> str | None:
    """The longest LAYERS prefix naming ``module`` (a package, a module, or a name inside one)."""
    hits = [p for p in LAYERS if module == p or module.startswith(p + ".")]
    return max(hits, key=len) if hits else None


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    parts[0] = MAPPED.get(parts[0], parts[0])
    return ".".join(parts).removesuffix(".__init__")


def project_modules() -> dict[str, Path]:
    """Every module by its installed name; es_ray/__init__.py (the checkout finder, importing nothing of ours)
    is no layer's."""
    mods = {module_name(p): p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))}
    mods.pop("es_ray", None)
    return mods


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                lines.update(range(sub.lineno, (sub.end_lineno or sub.lineno) + 1))
    return lines


def imports(path: Path, known: set[str]) -> list[tuple[int, str]]:
    """(line, imported project module) for every import in ``path`` outside TYPE_CHECKING blocks; a name imported
    from a package counts as that package's submodule when it is one."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_lines(tree)
    out = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] in PACKAGES]
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and node.module
            and node.module.split(".")[0] in PACKAGES
        ):  # grpo/launch here: the old names, refused below
            subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known]
            out += [(node.lineno, m) for m in subs] or [(node.lineno, node.module)]
    return out


def import_graph() -> dict[str, list[tuple[int, str]]]:
    mods = project_modules()
    return {m: imports(p, set(mods)) for m, p in mods.items()}


def test_grpo_and_launch_are_imported_by_their_installed_names():
    """`import grpo...` / `import launch...` would load a second copy of a module in a checkout and fail in a
    wheel, which installs them only as es_ray.grpo and es_ray.launch."""
    files = [
        p for d in (*PACKAGES, "tests", "scripts", "benchmarks", "docker") for p in sorted((REPO / d).rglob("*.py"))
    ]
    old = [
        f"{p.relative_to(REPO)}:{line} imports {name}"
        for p in files
        for line, name in imports(p, set())
        if name.split(".")[0] in MAPPED
    ]
    assert old == []


def test_every_project_module_has_a_layer():
    assert [m for m in project_modules() if group_of(m) is None] == []


def test_imports_point_down_the_layers_and_methods_do_not_import_each_other():
    bad = []
    for mod, found in import_graph().items():
        mine = group_of(mod)
        for line, other in found:
            theirs = group_of(other)
            if theirs is None or theirs == mine or mine.startswith(theirs + ".") or theirs.startswith(mine + "."):
                continue
            if LAYERS[theirs] > LAYERS[mine] or (mine in METHODS and theirs in METHODS):
                bad.append(
                    f"{mod}:{line} imports {other} ({theirs}, layer {LAYERS[theirs]} above {mine}'s {LAYERS[mine]})"
                    if LAYERS[theirs] > LAYERS[mine]
                    else f"{mod}:{line} imports the method {other}"
                )
    assert bad == []


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_between_modules():
    mods = set(project_modules())

    def owner(name: str) -> str | None:  # the project module a dotted import name lands in
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {
        m: {o for _, n in found if (o := owner(n)) and o != m and not m.startswith(o + ".")}
        for m, found in import_graph().items()
    }
    assert circles(graph) == []


def test_the_rules_can_fail():
    """The circle finder and the layer rule see what they are meant to see."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert group_of("es_ray.engines.vllm") == "es_ray.engines" and group_of("es_ray.grpo.loss") == "es_ray.grpo.loss"
    assert LAYERS[group_of("es_ray.runtime.actors")] > LAYERS[group_of("es_ray.models")]


def imports_of(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, module) for every import in ``source`` (function-local ones included) of a module in ``names``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] in names]
        elif (
            isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.split(".")[0] in names
        ):
            out.append((node.lineno, node.module))
    return sorted(out)


def test_no_test_module_imports_another():
    """Shared test code lives in tests/helpers.py (and es_test_tasks.py, strict_collectives.py, conftest.py): a
    test module importing another breaks when that one is moved or renamed, and runs its module-level code."""
    tests = {p.stem: p for p in sorted((REPO / "tests").rglob("test_*.py"))}
    sample = "import os\ndef f():\n    from test_a import x\nimport test_b.c\n"  # the check can fail
    assert imports_of(sample, {"test_a", "test_b"}) == [(3, "test_a"), (4, "test_b.c")]
    bad = [
        f"{p.relative_to(REPO)}:{line} imports {name}"
        for p in tests.values()
        for line, name in imports_of(p.read_text(), set(tests))
    ]
    assert bad == [], "move what they share into tests/helpers.py"


def torch_modules_after(code: str) -> str:
    """Runs ``code`` in a fresh interpreter and returns the torch modules it left imported, as a printed list."""
    import subprocess
    import sys

    code += '\nimport sys\nprint(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))\n'
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_the_es_driver_prepares_a_run_without_torch(tiny_model_dir, tmp_path):
    """es-train's driver sends seeds and reads rewards: its modules, the config's checks and everything ``prepare``
    does before an actor starts (memory plan, model and task resolved, the perturbation's preflight, the run dir)
    import no torch, which took 1.2-1.3 s of every command's start (docs/running.md "Start-up and shutdown")."""
    code = f"""
from es_ray.es.config import replica_spec, to_train_config
from es_ray.es.driver import preflight_perturbation, run  # noqa: F401
from es_ray.runtime.loop import prepare
cfg = to_train_config({{"model": {{"path": {str(tiny_model_dir)!r}}}, "run": {{"dir": {str(tmp_path / "run")!r}}}}})
prepare(cfg, "es", (), lambda model_dir: preflight_perturbation(cfg, model_dir))
replica_spec(cfg)
"""
    assert torch_modules_after(code) == "[]"


def test_the_grpo_driver_checks_and_prepares_a_run_without_torch(tiny_model_dir, tmp_path):
    """grpo-train's driver imports torch only for its first step's advantages: the config's checks (grpo.loss_type
    and grpo.adv_scale's names are grpo/loss_kinds.py's, not grpo/loss.py's) and ``prepare`` import none; the
    import took 1.3-2.0 s of every grpo-train's start (docs/running.md "Start-up and shutdown")."""
    code = f"""
from es_ray.grpo.config import RESUME_FREE, to_grpo_config
from es_ray.grpo.driver import run  # noqa: F401
from es_ray.runtime.loop import prepare
cfg = to_grpo_config({{"model": {{"path": {str(tiny_model_dir)!r}}}, "run": {{"dir": {str(tmp_path / "run")!r}}},
                      "grpo": {{"loss_type": "dapo", "adv_scale": "batch"}}}})
prepare(cfg, "grpo", RESUME_FREE)
"""
    assert torch_modules_after(code) == "[]"


ENGINE_INTERFACE = {"es_ray.engines", "es_ray.engines.base"}
"""What code outside es_ray/engines may import of it: the registry and the engines' traits, the interface
(``make_engine``, ``ReplicaHost``) and what an engine allocates (the memory plan's lines); an engine's own module (hf,
vllm, ...) is reached through ``make_engine`` only."""


def engine_name_tests(source: str) -> list[int]:
    """Lines comparing an ``engine.name`` with a string, a collection of strings or an UPPER_CASE constant (a list of
    engine names): asking which engine it is instead of what it can do."""

    def is_engine_name(node: ast.AST) -> bool:
        return (
            isinstance(node, ast.Attribute)
            and node.attr == "name"
            and ast.unparse(node.value).rpartition(".")[2] == "engine"
        )

    def names_engines(node: ast.AST) -> bool:
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(names_engines(e) for e in node.elts)
        return (isinstance(node, ast.Constant) and isinstance(node.value, str)) or (
            isinstance(node, ast.Name) and node.id.isupper()
        )

    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(map(is_engine_name, sides)) and any(names_engines(s) for s in sides if not is_engine_name(s)):
                out.append(node.lineno)
    return sorted(out)


def test_engines_are_asked_what_they_can_do_not_named():
    """es_ray/engines/__init__.py: outside es_ray/engines no code tests ``engine.name`` against a name or imports an
    engine's module; what differs between engines is a trait (``ENGINES``: sleep mode, in-process evaluation, LoRA
    slots, ...), so a third engine is added there and nowhere else."""
    sample = (
        'if cfg.engine.name != "vllm":\n    pass\nothers = [n for n in names if n != engine.name]\n'
        'local = cfg.engine.name in IN_PROCESS\nhf = self.engine.name in ("hf",)\n'
    )
    assert engine_name_tests(sample) == [1, 4, 5]  # the check can fail; line 3 lists the others by the registry
    mods = project_modules()
    outside = {m: p for m, p in mods.items() if group_of(m) != "es_ray.engines"}
    bad = [
        f"{m}:{line} imports {name}"
        for m, p in outside.items()
        for line, name in imports(p, set(mods))
        if group_of(name) == "es_ray.engines" and name not in ENGINE_INTERFACE
    ]
    bad += [f"{m}:{line} tests engine.name" for m, p in outside.items() for line in engine_name_tests(p.read_text())]
    assert bad == [], "ask the engine's traits (es_ray/engines/__init__.py ENGINES) instead"


def test_a_low_rank_config_is_checked_without_torch():
    """es.perturbation=lowrank asks the engine's traits for the ranks it serves (es_ray/engines/__init__.py): the
    transformers engine answers without its module, so the check imports no torch (it imported es_ray.engines.hf,
    and torch with it, while the traits named "module:function" strings)."""
    code = """
from es_ray.es.config import to_train_config
to_train_config({"engine": {"name": "hf", "device": "cpu"}, "es": {"perturbation": "lowrank", "rank": 4}})
"""
    assert torch_modules_after(code) == "[]"
