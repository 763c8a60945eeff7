"""docs/config.md is scripts/config_reference.py's output (the configuration reference generated from the config
dataclasses), and every key of every entry point has a docstring there."""

from __future__ import annotations

import subprocess
import sys

from paths import REPO


def generated() -> str:
    res = subprocess.run(
        [sys.executable, "scripts/config_reference.py"], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout


def test_docs_config_is_the_generated_reference():
    assert (REPO / "docs" / "config.md").read_text() == generated(), (
        "docs/config.md is stale: python scripts/config_reference.py > docs/config.md"
    )


def test_every_key_is_documented_and_lists_its_registered_values():
    rows = [line for line in generated().splitlines() if line.startswith("| `")]
    assert len(rows) > 150
    assert [r.split("|")[1].strip() for r in rows if r.rstrip().endswith("|  |")] == []
    by_key = {r.split("|")[1].strip().strip("`"): r for r in rows}
    assert "`lowrank` (each linear layer's weight gets" in by_key["es.perturbation"]
    assert "`antithetic`" in by_key["es.estimator"] and "`bf16_mixed`" in by_key["grpo.dtype"]
    assert by_key["es.population"].split("|")[2].strip() == "`8`"
