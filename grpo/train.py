"""`grpo-train`: GRPO on Ray, configured with Hydra over the typed schema in grpo.config.

    grpo-train task.name=arithmetic grpo.steps=24 grpo.group_size=8 run.dir=/abs/path
"""

from __future__ import annotations

import sys

from es_ray.train import CONF_DIR


def _main(dict_cfg) -> None:
    from es_ray.config import ConfigError
    from es_ray.models import ModelNotFoundError
    from es_ray.tasks.base import TaskLoadError
    from grpo.config import to_grpo_config
    from grpo.driver import run

    try:
        run(to_grpo_config(dict_cfg))
    except (ConfigError, ModelNotFoundError, TaskLoadError) as exc:
        print(f"grpo-train: {type(exc).__name__}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def main() -> None:
    import hydra

    from grpo.config import register_configs

    register_configs()
    if not CONF_DIR.is_dir():
        raise SystemExit(f"grpo-train: Hydra presets not found at {CONF_DIR}; "
                         "install the project with `pip install -e .`")
    hydra.main(config_path=str(CONF_DIR), config_name="grpo_train", version_base="1.3")(_main)()


if __name__ == "__main__":
    main()
