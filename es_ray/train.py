"""`es-train`: ES fine-tuning on Ray, configured with Hydra over the typed schema in es_ray.config.

    es-train task.name=countdown es.population=8 es.iterations=5 run.dir=/abs/path
    es-train experiment=cpu_demo
"""

from __future__ import annotations

import sys
from pathlib import Path

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def _main(dict_cfg) -> None:
    from es_ray.config import ConfigError, to_config
    from es_ray.driver import run
    from es_ray.models import ModelNotFoundError
    from es_ray.tasks.base import TaskLoadError

    try:
        cfg = to_config(dict_cfg)
        run(cfg)
    except (ConfigError, ModelNotFoundError, TaskLoadError) as exc:
        print(f"es-train: {type(exc).__name__}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def main() -> None:
    import hydra

    from es_ray.config import register_configs

    register_configs()
    if not CONF_DIR.is_dir():
        raise SystemExit(f"es-train: Hydra presets not found at {CONF_DIR}; install the project with `pip install -e .`")
    hydra.main(config_path=str(CONF_DIR), config_name="es_train", version_base="1.3")(_main)()


if __name__ == "__main__":
    main()
