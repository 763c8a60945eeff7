"""Evaluation jobs over checkpoints, above the platform and beside the methods:

    config     their Hydra schemas (EvalJobConfig, DriftJobConfig, BenchmarkConfig) and checks
    es_eval    `es-eval`: pass@k, maj@k and token entropy of checkpoints on benchmarks, on Ray
    worker     its actor: one seeded chunk of problems through an engine
    es_drift   `es-drift`: two checkpoints' weights compared one tensor pair at a time

The metrics themselves are pure functions in ``es_ray.metrics``.
"""
