"""Launching es_ray runs on Ray clusters: `es-submit` (Ray Jobs), the runtime_env, cluster launcher configs, KubeRay."""
