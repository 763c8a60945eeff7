"""The suite's layout (tests/layout.py, docs/running.md "Where a test goes"): every test module sits in a folder
that mirrors the package, none at the top of tests/, each name once, and none finds the repository or the fixtures
from its own depth, so a module moves between folders unchanged."""

from __future__ import annotations

import re

from layout import FOLDERS, SHARED, area_of, misplaced, suggest
from paths import REPO, TESTS

DEPTH = re.compile(r"Path\(__file__\)(?:\.resolve\(\))?\.parents?\b")
"""A place computed from the module's own folder: tests/paths.py names it once (REPO, TESTS, FIXTURES)."""


def test_no_test_module_is_left_at_the_top_of_tests():
    moves = [f"git mv tests/{path.name} tests/{folder}/{path.name}" for path, folder in misplaced()]
    assert moves == [], (
        "test modules at the top of tests/ go in the folder of the code they test (docs/running.md "
        "\"Where a test goes\"); `python tests/layout.py` prints:\n" + "\n".join(moves)
    )


def test_every_test_module_sits_in_a_folder_of_the_layout():
    where = {p.relative_to(TESTS).parent.as_posix() for p in TESTS.rglob("test_*.py")} - {"."}  # the top: above
    assert sorted(where - set(FOLDERS)) == [], f"the folders are tests/layout.py's FOLDERS: {', '.join(FOLDERS)}"
    # pytest imports a module of a folder without __init__.py by its name, with its folder on sys.path; a package
    # would be imported as tests.grpo..., and a tests/grpo package on sys.path would stand for the project's grpo
    assert sorted(p.relative_to(REPO).as_posix() for p in TESTS.rglob("__init__.py")) == []


def test_only_the_shared_modules_are_not_tests():
    """A helper at the top of tests/ is one of SHARED; one inside a folder would stand, for that folder's modules, for
    the shared one of its name (each folder is put on sys.path): helpers live at the top, under their own name."""
    code = [p for p in TESTS.rglob("*.py") if not p.name.startswith("test_") and "fixtures" not in p.parts]
    assert sorted(p.name for p in code if p.parent == TESTS) == sorted(SHARED)
    assert sorted(p.relative_to(REPO).as_posix() for p in code if p.parent != TESTS) == []


def test_a_test_module_name_is_used_once():
    seen: dict[str, list[str]] = {}
    for p in sorted(TESTS.rglob("test_*.py")):
        seen.setdefault(p.name, []).append(p.relative_to(REPO).as_posix())
    assert {n: ps for n, ps in seen.items() if len(ps) > 1} == {}, "rename one: pytest imports each by its name"


def test_no_test_module_finds_a_place_from_its_own_depth():
    bad = [
        f"{p.relative_to(REPO)}:{n}: {line.strip()}"
        for p in sorted(TESTS.rglob("test_*.py"))
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if DEPTH.search(line)
    ]
    here = "Path(__file__)"  # split, so that this line is no example of what it finds
    assert DEPTH.search(f"ROOT = {here}.resolve().parents[1]") and DEPTH.search(f"{here}.parent / 'fixtures'")
    assert not DEPTH.search(f"this = {here}.resolve()")
    assert bad == [], "import REPO, TESTS or FIXTURES from tests/paths.py instead:\n" + "\n".join(bad)


def test_every_module_of_the_package_has_a_folder():
    """A new part of the package names its tests' folder in layout.AREAS (es_ray.models, the model a test loads,
    names none)."""
    mapped = {"grpo": "es_ray.grpo", "launch": "es_ray.launch"}
    names = []
    for top in ("es_ray", "grpo", "launch"):
        for p in sorted((REPO / top).rglob("*.py")):
            parts = list(p.relative_to(REPO).with_suffix("").parts)
            parts[0] = mapped.get(parts[0], parts[0])
            names.append(".".join(parts).removesuffix(".__init__"))
    assert len(names) > 100 and area_of("es_ray.launch.compare.run") == "launch/compare"
    assert [m for m in names if area_of(m) is None and m not in {"es_ray", "es_ray.models"}] == []


def test_the_suggestion_follows_the_name_then_the_imports(tmp_path):
    def module(name: str, source: str):
        path = tmp_path / f"{name}.py"
        path.write_text(source)
        return suggest(path)

    assert module("test_grpo_thing", "from es_ray.metrics.passk import pass_at_k\n") == "grpo"  # the name first
    assert (
        module(
            "test_thing",
            "from es_ray.metrics import passk\nfrom es_ray.metrics.kl import kl\n"
            "def f():\n    from es_ray.runtime.loop import due\n",
        )
        == "metrics"
    )
    assert module("test_thing", "from es_ray.launch.compare.run import main\n") == "launch/compare"
    assert (
        module(
            "test_thing",
            "from es_ray.core.config import TaskConfig\nfrom es_ray.strategy import ask\n"
            "from es_ray.core.dtypes import resolve_dtype\n",
        )
        == "es"
    )  # core only as a last resort
    assert module("test_thing", "from es_ray.core.config import TaskConfig\n") == "core"
    assert module("test_thing", "import json\nfrom es_ray.models import resolve_model\n") == "repo"
