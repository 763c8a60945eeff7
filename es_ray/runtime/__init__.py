"""The runtime every method runs on: ES, GRPO and evaluation alike.

    config     shared config sections, checks (ConfigError names the key to change), DictConfig -> dataclass
    registry   one list of names per option; the registry is the validator and the dispatch
    dtypes     the one dtype resolution (an unknown name is refused, never silently fp32)
    cluster    connecting to Ray: the address check, a local Ray when none is given
    rundir     the run directory, config.json, the same-run check on resume, metrics with a torn last line cut
    entry      the Hydra entry point and its error handling (one line, exit code 2)
    signals    SIGTERM / Ctrl-C as an exception at safe points
    placement  one placement group per run, the fit check
    actors     ONE actor group: placement, gather with timeouts, replacement of dead or hung actors
    ledger     ONE compute ledger, filled the same way for every method
    tracking   the driver's tracker and phase timer
    checkpoint HF-format checkpoint directories written atomically

Nothing here imports a method (es_ray's ES modules, grpo, the comparison).
"""
