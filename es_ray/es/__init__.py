"""The ES method on Ray (`es-train`), above the platform (runtime, engines, replica, tasks, grading):

config     its Hydra schema (ESTrainConfig and its sections) and their checks
train      the es-train entry point
driver     the Ray driver: sends seeds, gathers scalar rewards, sends the aggregated update
worker     the actor: perturbs its replica in place, generates, scores, applies the update
protocol   the typed requests and results between them
state      the append-only seed log and ES checkpoints
recovery   exact resume and replicas rebuilt from the seed log
faults     fault injection for the fault-tolerance tests
"""
