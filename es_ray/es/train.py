"""`es-train`: ES fine-tuning on Ray, configured with Hydra over the typed schema in es_ray.es.config.

es-train task.name=countdown es.population=8 es.iterations=5 run.dir=/abs/path
es-train experiment=es_reference_gsm8k
"""

from __future__ import annotations

from es_ray.es.config import register_configs, to_train_config
from es_ray.runtime.entry import hydra_main, run_or_exit
from es_ray.runtime.rundir import resumed_config


def _main(dict_cfg) -> None:
    # The driver (and the runtime and the recovery under it) are imported when a run starts: --help and a config
    # error start 0.3-0.5 s sooner without them.
    from es_ray.es.driver import run
    from es_ray.es.recovery import RESUME_FREE

    # run.resume=true run.dir=X alone continues X with its saved config.json
    run_or_exit("es-train", lambda: run(to_train_config(resumed_config(dict_cfg, "es", RESUME_FREE))))


def main() -> None:
    hydra_main("es_train", _main, "es-train", register_configs)


if __name__ == "__main__":
    main()
