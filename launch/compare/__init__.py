"""`es-compare`: ES and GRPO trained and evaluated side by side, and the verdict:

methods    the methods it compares: labels, which are trained, how each stage is built
config     the schema (CompareConfig) and its checks
stages     the stages of each method and seed, and how each is built and run
run        the run and the command: run directory, resume, the report
report     the verdict: paired tests over problems and seeds, power, budgets reached
markdown   the report's Markdown
plots      its figures
"""
