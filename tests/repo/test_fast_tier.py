"""The fast tier's rule (tests/conftest.py ``is_fast``): every module it names exists, so a renamed module cannot slip
its tests into `pytest -m fast` unnoticed, and a test that starts a process or takes the tiny model is left out."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

from conftest import NOT_FAST_MODULES, TESTS_DIR, is_fast


def test_every_module_the_rule_names_exists():
    """By name, in any folder of tests/ (a name is unique across them: pytest imports each module by it)."""
    modules = {p.stem for p in TESTS_DIR.rglob("test_*.py")}
    assert "test_fast_tier" in modules and sorted(NOT_FAST_MODULES - modules) == []


def _starts_a_process():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def _pure():
    return 1 + 1


def item(function, module: str = "test_fast_tier", fixtures=(), marker=None):
    return SimpleNamespace(
        function=function,
        fspath=TESTS_DIR / f"{module}.py",
        fixturenames=list(fixtures),
        get_closest_marker=lambda name: name if name == marker else None,
    )


def test_the_rule_sorts_by_module_fixture_marker_and_source():
    assert is_fast(item(_pure))
    assert not is_fast(item(_starts_a_process))
    assert not is_fast(item(_pure, fixtures=["tiny_model_dir"]))
    assert not is_fast(item(_pure, marker="slow")) and not is_fast(item(_pure, marker="ray"))
    assert not is_fast(item(_pure, module=sorted(NOT_FAST_MODULES)[0]))
