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
    has stored the entry point's schema in Hydra's ConfigStore. ``--help`` lists only the presets that compose
    with this entry point."""
    import hydra

    register()
    if not CONF_DIR.is_dir():
        raise SystemExit(f"{prog}: Hydra presets not found at {CONF_DIR}; install the project with `pip install -e .`")
    if sys.argv[1:] == ["--help"]:
        print(help_text(prog, config_name))
        return
    hydra.main(config_path=str(CONF_DIR), config_name=config_name, version_base="1.3")(fn)()


def composable_presets(config_name: str) -> dict[str, list[str]]:
    """Every preset group under conf/ with the options that compose with this entry point's schema (the schema
    must be registered): experiment presets are written for one entry point or another, and Hydra's own help
    would list them all."""
    from hydra import compose, initialize_config_dir

    out = {}
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for group in sorted(p for p in CONF_DIR.iterdir() if p.is_dir()):
            ok = []
            for option in sorted(f.stem for f in group.glob("*.yaml")):
                for override in (f"{group.name}={option}", f"+{group.name}={option}"):
                    try:
                        compose(config_name=config_name, overrides=[override])
                    except Exception:  # noqa: BLE001 - a preset for another entry point, or a group this one lacks
                        continue
                    ok.append(option)
                    break
            if ok:
                out[group.name] = ok
    return out


def help_text(prog: str, config_name: str) -> str:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    groups = composable_presets(config_name)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name=config_name)
    lines = [f"{prog}: Hydra application; override any key as key=value, pick presets as group=option.", "",
             "== Configuration groups (the presets that compose with this command) ==", ""]
    lines += [f"{group}: {', '.join(options)}" for group, options in groups.items()]
    lines += ["", "== Config (defaults) ==", "", OmegaConf.to_yaml(cfg)]
    return "\n".join(lines)
