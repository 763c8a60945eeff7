"""The suite's places, named once: a test module in any folder of tests/ reads the repository, the shared fixtures
and tests/ itself through these, never through its own depth (``Path(__file__).parents[n]``), so moving it to
another folder changes nothing inside it (tests/repo/test_suite_layout.py checks it)."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent
"""tests/: the shared modules (conftest, helpers, es_test_tasks ...) that Ray workers and subprocesses import."""
REPO = TESTS.parent
FIXTURES = TESTS / "fixtures"
