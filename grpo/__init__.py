"""GRPO on the same Ray cluster, engines, tasks and outputs as es_ray: the comparison baseline."""
