"""`grpo-train`: GRPO on Ray, configured with Hydra over the typed schema in grpo.config.

    grpo-train task.name=arithmetic grpo.steps=24 grpo.group_size=8 run.dir=/abs/path
"""

from __future__ import annotations

import sys


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
    from es_ray.evaluate import _hydra
    from grpo.config import register_configs

    _hydra("grpo_train", _main, "grpo-train", register=register_configs)


if __name__ == "__main__":
    main()
