"""The Hydra entry point every console script uses, and its error handling.

A user's mistake (a bad setting, a missing model or dataset, an unreachable cluster) is one line on stderr that
names what to change, and exit code 2; never a traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def user_errors() -> tuple[type[BaseException], ...]:
    from es_ray.models import ModelNotFoundError
    from es_ray.core.config import ConfigError
    from es_ray.tasks.base import TaskLoadError

    return ConfigError, ModelNotFoundError, TaskLoadError


def run_or_exit(prog: str, fn: Callable[[], Any]) -> Any:
    """``fn()``; a user error becomes one line on stderr and exit code 2."""
    try:
        return fn()
    except user_errors() as exc:
        print(f"{prog}: {type(exc).__name__}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def hydra_main(config_name: str, fn: Callable[[Any], None], prog: str, register: Callable[[], None]) -> None:
    """Run ``fn(composed DictConfig)`` as a Hydra application over conf/<config_name>.yaml, after ``register()``
    has stored the entry point's schema in Hydra's ConfigStore."""
    import hydra

    register()
    if not CONF_DIR.is_dir():
        raise SystemExit(f"{prog}: Hydra presets not found at {CONF_DIR}; install the project with `pip install -e .`")
    hydra.main(config_path=str(CONF_DIR), config_name=config_name, version_base="1.3")(fn)()
