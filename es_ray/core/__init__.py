"""The bottom layer every other module may import, and which imports nothing else of the project:

config     the shared config sections (the Hydra schema), ConfigError and the value checks
registry   a named list of options that is also their validator and dispatch
dtypes     the one dtype resolution
manifest   a directory's file digests and the checks against them (checkpoints)
"""
